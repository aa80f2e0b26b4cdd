# shellcheck shell=bash
#
# What launch.sh, setup_ssh.sh and check_env.py share: the hosts file, how ssh reaches a
# host, the command that runs bash there, and what ssh's refusals mean. Source it after
# defining die MESSAGE (prints, exits 2). Run as a command, it serves check_env.py:
#   bash lib/hosts.sh HOSTFILE                prints LABEL<TAB>LOCAL<TAB>the ssh command, a host
#   bash lib/hosts.sh --ssh-failure HOSTFILE  reads ssh's output, prints why it failed
#
# One host per line, [user@]host[:port]; '#' starts a comment. Any other character
# (a shell metacharacter above all) is an error, so no line can ever run a command.
# localhost and this machine's names and addresses, without user or port, are local:
# they run here without SSH.

is_port() {
  [[ $1 =~ ^[0-9]{1,5}$ ]] && ((10#$1 >= 1 && 10#$1 <= 65535))
}

require_file() {
  [[ -e $1 ]] || die "$1: no such file"
  [[ ! -d $1 ]] || die "$1: is a directory"
  [[ -r $1 ]] || die "$1: no permission to read it"
}

# Appends each host of file $1 to the caller's arrays labels (the line), destinations
# ([user@]host), ports (may be empty) and local_node (yes or empty).
read_hostfile() {
  local file=$1 line n=0 user host port key is_local own
  local -A seen=()
  require_file "$file"
  own=" localhost $HOSTNAME ${HOSTNAME%%.*} $(hostname -f 2>/dev/null) $(hostname -I 2>/dev/null) "
  own=${own,,}
  while IFS= read -r line || [[ -n $line ]]; do
    n=$((n + 1))
    ((n > 1)) || line=${line#$'\xef\xbb\xbf'} # the byte-order mark some Windows editors write
    line=${line%%#*}
    line=${line#"${line%%[![:space:]]*}"}
    line=${line%"${line##*[![:space:]]}"} # (CRLF's \r too)
    [[ -n $line ]] || continue
    [[ $line =~ ^(([A-Za-z0-9_][A-Za-z0-9._-]*)@)?([A-Za-z0-9_][A-Za-z0-9._-]*)(:([0-9]+))?$ ]] \
      || die "$file:$n: not a [user@]host[:port]: $(LC_ALL=C printf %q "$line")" # %q shows the invisible
    user=${BASH_REMATCH[2]} host=${BASH_REMATCH[3]} port=${BASH_REMATCH[5]}
    [[ -z $port ]] || is_port "$port" || die "$file:$n: bad port: $line"
    key="${host,,}:${port:-22}" is_local=''
    if [[ -z $user$port && ($own == *" ${host,,} "* || $host == 127.*) ]]; then
      is_local=yes key=this-machine # under any of its names: two nodes would share its GPUs
    fi
    [[ -z ${seen[$key]:-} ]] || die "$file:$n: duplicate host: $line (${is_local:+this machine, }also on line ${seen[$key]})"
    seen[$key]=$n
    labels+=("$line") destinations+=("${user:+$user@}$host") ports+=("$port") local_node+=("$is_local")
  done <"$file"
  ((${#labels[@]})) || die "$file: no hosts"
}

# Against a config made for interactive use: a forced tty, a RemoteCommand (tmux), forwards.
SSH_OPTIONS=(-T -o ConnectTimeout=5 -o ServerAliveInterval=5 -o ServerAliveCountMax=3
  -o RemoteCommand=none -o ClearAllForwardings=yes)

# Sets the caller's ssh_command to $SSH_COMMAND split on spaces (unset or blank: ssh),
# then SSH_OPTIONS: ssh takes the first value it is given for an option.
read_ssh_command() {
  read -ra ssh_command <<<"${SSH_COMMAND:-}"
  ((${#ssh_command[@]})) || ssh_command=(ssh)
  ssh_command+=("${SSH_OPTIONS[@]}")
}

# Prints its arguments single-quoted for bash, space-separated.
quote_words() {
  local word quoted=()
  for word; do quoted+=("'${word//\'/\'\\\'\'}'"); done
  echo "${quoted[*]}"
}

# Prints the command for ssh that runs bash script $1 with arguments "${@:2}" on a host.
# The login shell there may be sh, zsh, fish or tcsh: base64 holds nothing they parse.
remote_bash_command() {
  local payload
  payload=$(printf 'set -- %s\n%s\n' "$(quote_words "${@:2}")" "$1" | base64 | tr -d '\n')
  echo "bash -c 'eval \"\$(echo $payload | base64 -d)\"'"
}

# Prints why ssh failed, from its output $1, with the fix in parentheses where one is
# known; $2, if given, is the setup_ssh.sh command that installs a key or a host's key.
ssh_failure() {
  local line fix=''
  # A PAM module's refusal or sshd's reason come before ssh's own last line.
  line=$(grep -m 1 -e '^Access denied' -e '^Received disconnect from ' <<<"$1") \
    || line=$(grep -v '^[[:space:]]*$' <<<"$1" | tail -n 1) || true
  case $1 in
    *'REMOTE HOST IDENTIFICATION HAS CHANGED'*)
      fix=$(grep -A 1 '^ *remove with:' <<<"$1" | grep -o 'ssh-keygen.*') || fix='remove the old key from known_hosts'
      fix="its key changed since it was recorded: find out why, then ${fix%$'\r'}" ;;
    *'Too many authentication failures'*)
      fix="ssh offers other keys first, more than the host takes: give these hosts 'IdentityFile KEY'"
      fix+=" and 'IdentitiesOnly yes' in ~/.ssh/config" ;;
    *'Access denied'*'active jobs'*) # Slurm's pam_slurm_adopt
      fix="Slurm lets in only users with a job there: work in an allocation of them, or use train.sbatch" ;;
    *'Permission denied ('*) fix=${2:+"$2 installs your key (one with a passphrase needs ssh-add first)"} ;;
    *'Host key verification failed.'*) fix=${2:+"$2 records a new host's key"} ;;
  esac
  line=${line%$'\r'}
  echo "${line:-ssh said nothing}${fix:+ ($fix)}"
}

if [[ ${BASH_SOURCE[0]} == "$0" ]]; then # run as a command
  set -euo pipefail
  die() {
    echo "${0##*/}: $*" >&2
    exit 2
  }
  [[ $# == 1 || ($# == 2 && $1 == --ssh-failure) ]] \
    || die "usage: lib/hosts.sh [--ssh-failure] HOSTFILE"
  if [[ $1 == --ssh-failure ]]; then
    setup_ssh=$(readlink -f -- "${BASH_SOURCE[0]}")
    ssh_failure "$(cat)" "$(printf '%q %q' "${setup_ssh%/lib/*}/setup_ssh.sh" "$2")"
    exit
  fi
  labels=() destinations=() ports=() local_node=() ssh_command=()
  read_hostfile "$1"
  read_ssh_command
  for i in "${!labels[@]}"; do
    printf '%s\t%s' "${labels[i]}" "${local_node[i]}"
    [[ -n ${local_node[i]} ]] || printf '\t%s' "${ssh_command[@]}" -o BatchMode=yes -o LogLevel=INFO \
      ${ports[i]:+-p "${ports[i]}"} "${destinations[i]}"
    echo
  done
fi
