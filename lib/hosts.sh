# shellcheck shell=bash
#
# What launch.sh and setup_ssh.sh share: reading a hosts file and SSH_COMMAND,
# and the command line that runs bash on a host. Source it; the caller defines
# die MESSAGE (prints and exits 2).
#
# One host per line, [user@]host[:port]; '#' starts a comment. A line with any
# other character (a shell metacharacter above all) is an error, so no line
# can ever run a command. localhost and this machine's own name or addresses,
# written without user or port, are local: they run here without SSH.

trim() {
  local text=$1
  text=${text#"${text%%[![:space:]]*}"}
  printf '%s\n' "${text%"${text##*[![:space:]]}"}" # (echo would take -n, -e as options)
}

is_port() {
  [[ $1 =~ ^[0-9]{1,5}$ ]] && ((10#$1 >= 1 && 10#$1 <= 65535))
}

# Dies unless $1 is a file this script can read (a pipe, as from <(...), is one).
require_readable_file() {
  [[ -e $1 ]] || die "$1: no such file"
  [[ ! -d $1 ]] || die "$1: is a directory"
  [[ -r $1 ]] || die "$1: no permission to read it"
}

# Appends each host of file $1 to the caller's arrays labels (the line),
# destinations ([user@]host), ports (may be empty) and local_node ("yes" or
# empty); dies on a malformed line, a duplicate or an empty file.
read_hostfile() {
  local file=$1 line n=0 user host name port key is_local hint node_name own_names=() addresses=()
  local -A seen=()
  require_readable_file "$file"
  node_name=$(uname -n)
  own_names=(localhost "$node_name" "${node_name%%.*}" "$(hostname -f 2>/dev/null || true)")
  read -ra addresses <<<"$(hostname -I 2>/dev/null || true)"
  own_names+=("${addresses[@]}")
  own_names=("${own_names[@],,}")
  while IFS= read -r line || [[ -n $line ]]; do
    n=$((n + 1))
    ((n > 1)) || line=${line#$'\xef\xbb\xbf'} # the byte-order mark some Windows editors write
    line=$(trim "${line%%#*}")
    [[ -n $line ]] || continue
    if [[ ! $line =~ ^(([A-Za-z0-9_][A-Za-z0-9._-]*)@)?([A-Za-z0-9_][A-Za-z0-9._-]*)(:([0-9]{1,5}))?$ ]]; then
      hint=''
      if [[ $line == *[[:space:]]slots=* ]]; then
        hint=" (DeepSpeed's and MPI's slots=N has no place here: launch.sh's NPROC_PER_NODE applies to every host)"
      fi
      die "$file:$n: not a [user@]host[:port]: $(LC_ALL=C printf %q "$line")$hint" # %q shows what is invisible
    fi
    user=${BASH_REMATCH[2]} host=${BASH_REMATCH[3]} port=${BASH_REMATCH[5]}
    [[ -z $port ]] || is_port "$port" || die "$file:$n: bad port: $line"
    name=${host,,} # host names are case-insensitive
    key="$name:${port:-22}"
    is_local=''
    if [[ -z $user && -z $port ]] && [[ " ${own_names[*]} " == *" $name "* || $host == 127.* ]]; then
      is_local=yes
      key=this-machine # under any of its names: two nodes would share its GPUs
    fi
    if [[ -n ${seen[$key]:-} ]]; then
      die "$file:$n: duplicate host: $line (${is_local:+this machine, }also on line ${seen[$key]})"
    fi
    seen[$key]=$n
    labels+=("$line")
    destinations+=("${user:+$user@}$host")
    ports+=("$port")
    local_node+=("$is_local")
  done <"$file"
  ((${#labels[@]})) || die "$file: no hosts"
}

# Sets the caller's array ssh_command to $SSH_COMMAND split on spaces, or to
# ssh where that is unset or blank.
read_ssh_command() {
  read -ra ssh_command <<<"${SSH_COMMAND:-}"
  ((${#ssh_command[@]})) || ssh_command=(ssh)
}

# Dies unless this bash is at least version $1.$2.
require_bash() {
  if ((BASH_VERSINFO[0] * 100 + BASH_VERSINFO[1] < $1 * 100 + $2)); then
    die "needs bash $1.$2 or newer (this is $BASH_VERSION)"
  fi
}

# Prints its arguments single-quoted for bash, space-separated.
quote_words() {
  local word quoted=()
  for word; do
    quoted+=("'${word//\'/\'\\\'\'}'")
  done
  echo "${quoted[*]}"
}

# Prints the command line for ssh that runs bash script $1 with arguments
# "${@:2}" on a host. The login shell there may be sh, bash, zsh, fish or tcsh:
# script and arguments travel base64-encoded, so it sees no character it
# could treat differently.
remote_bash_command() {
  local script=$1 payload
  shift
  payload=$(printf 'set -- %s\n%s\n' "$(quote_words "$@")" "$script" | base64 | tr -d '\n')
  echo "bash -c 'eval \"\$(echo $payload | base64 -d)\"'"
}

# Prints the line of output $1 that says why a login or a command failed: a PAM
# module's refusal ("Access denied by pam_slurm_adopt: ..."), or sshd's reason
# for cutting ssh off ("Received disconnect from ...: Too many authentication
# failures"), which come before ssh's own last line ("Connection closed by
# ...", "Disconnected from ..."), else the last line that is not blank;
# without the \r that ssh ends its own lines with.
reason_line() {
  local line
  line=$(grep -m 1 -e '^Access denied' -e '^Received disconnect from ' <<<"$1") \
    || line=$(grep -v '^[[:space:]]*$' <<<"$1" | tail -n 1) || true
  echo "${line%$'\r'}"
}

# For ssh's output $1: where sshd cut ssh off for offering more keys than it
# takes (MaxAuthTries, 6 by default), before the one it would accept, prints
# what to do, in parentheses; else nothing.
too_many_keys_fix() {
  [[ $1 == *'Too many authentication failures'* ]] || return 0
  echo " (ssh offers other keys first, ssh-agent's say, more than the host takes: give these" \
    "hosts 'IdentityFile KEY' and 'IdentitiesOnly yes' in ~/.ssh/config)"
}

# For ssh's output $1: where it refused a changed host key, prints what to do,
# in parentheses (ssh's own command names the known_hosts entry as
# ~/.ssh/config's HostName, Port and HostKeyAlias make it); else nothing.
changed_host_key_fix() {
  local removal
  [[ $1 == *'REMOTE HOST IDENTIFICATION HAS CHANGED'* ]] || return 0
  removal=$(grep -A 1 '^ *remove with:' <<<"$1" | tail -n 1) || true
  removal=${removal#"${removal%%ssh-keygen*}"} removal=${removal%$'\r'}
  echo " (its key changed since it was recorded: find out why, then" \
    "${removal:-remove the old key from known_hosts})"
}
