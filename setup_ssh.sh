#!/usr/bin/env bash
#
# Usage: setup_ssh.sh [--key PATH] HOSTFILE
#
# Makes password-less (BatchMode) SSH work from here to every host in
# HOSTFILE (the format of launch.sh: [user@]host[:port] per line, '#'
# comments). localhost and this machine's own name or addresses are skipped.
#
# 1. Leaves alone each host where BatchMode login works already, with the
#    keys ssh offers by itself (the id_rsa a cluster made at first login, say).
# 2. Creates the key (default: ~/.ssh/id_ed25519, no passphrase) if a host
#    refuses those keys and it is missing; an existing key is never
#    overwritten. A new one named like ssh's own id_ecdsa or id_rsa is of
#    that type (FIPS mode refuses ed25519), any other an ed25519 key.
# 3. Adds its public key to ~/.ssh/authorized_keys on those hosts where it
#    is not there yet, under any comment (~/.ssh 700, the file 600). Only a host
#    that refuses the key is asked for a password: it comes from $SSHPASS
#    through `sshpass -e` when both are there, or is asked once per host.
#    New host keys are recorded with StrictHostKeyChecking=accept-new; a
#    changed host key stops that host. A key with a passphrase must be in
#    ssh-agent first (ssh-add), as launch.sh's BatchMode logins need it there.
# 4. Prints a table of whether BatchMode login works on each host, and exits 1
#    if it does not on any. A host that does not answer within 30 s (a login
#    that hangs) fails.
#
# Every ssh call runs $SSH_COMMAND (unset or blank: ssh), split on spaces, e.g.
# SSH_COMMAND='ssh -F ./cluster_ssh_config'.
#
# Options:
#   --key PATH  private key to use (default: ~/.ssh/id_ed25519)
#   -h, --help  show this help

if [ -z "${BASH_VERSION:-}" ] || shopt -oq posix; then # sh setup_ssh.sh: not bash, or bash as sh
  echo "setup_ssh.sh: run it with bash, not sh" >&2
  exit 2
fi
set -euo pipefail

# Through a symlink (~/bin/setup_ssh.sh, say), lib/ is beside the real file. BSD
# readlink before macOS 12.3 has no -f: then the path it was called by.
THIS_FILE=$(readlink -f -- "${BASH_SOURCE[0]}" 2>/dev/null) || THIS_FILE=${BASH_SOURCE[0]}
# shellcheck source=lib/hosts.sh
source "$(dirname -- "$THIS_FILE")/lib/hosts.sh"

readonly LOGIN_SECONDS=30 # a login that takes longer hangs

# Runs on each host, in bash: reads the public key's line from stdin and
# appends it to ~/.ssh/authorized_keys unless the key is there already (under
# any comment or options), on a line of its own even where the file's last
# line has no newline.
# shellcheck disable=SC2016 # expands there, not here
readonly INSTALL_KEY='umask 077 && read -r key && read -r _ blob _ <<<"$key" && [[ -n $blob ]] &&
mkdir -p ~/.ssh && chmod 700 ~/.ssh && keys=~/.ssh/authorized_keys &&
{ awk -v blob="$blob" "!/^[[:space:]]*#/ { for (i = 1; i <= NF; i++) if (\$i == blob) found = 1 }
  END { exit !found }" "$keys" 2>/dev/null ||
{ if [[ -s $keys && -n $(tail -c 1 "$keys") ]]; then echo; fi; echo "$key"; } >>"$keys"; } &&
chmod 600 "$keys"'

usage() {
  sed -n '3,/^$/s/^# \{0,1\}//p' "$0"
}

die() {
  echo "setup_ssh.sh: $*" >&2
  exit 2
}

# Keeps only the remote hosts: local ones need no key.
drop_local_hosts() {
  local i
  for i in "${!labels[@]}"; do
    if [[ -n ${local_node[i]} ]]; then unset 'labels[i]' 'destinations[i]' 'ports[i]'; fi
  done
}

# Dies unless $key is a private key usable in BatchMode, with its public key
# beside it; sets public_key.
check_key() {
  [[ -f $key.pub ]] || die "no $key.pub: --key takes a private key with its public key" \
    "beside it ('ssh-keygen -y -f $key > $key.pub' writes it)"
  read_public_key
  check_key_usable_without_prompt
}

create_key() {
  local type=ed25519
  case ${key##*/} in
    id_ecdsa) type=ecdsa ;;
    id_rsa) type=rsa ;;
  esac
  (umask 077 && mkdir -p "$(dirname -- "$key")")
  ssh-keygen -q -t "$type" -N '' -C "setup_ssh.sh@$(uname -n)" -f "$key" ||
    die "ssh-keygen cannot make a $type key $key (in FIPS mode, which refuses ed25519," \
      "--key ~/.ssh/id_ecdsa makes an ECDSA one)"
  echo "setup_ssh.sh: created $key" >&2
  read_public_key
}

# Sets public_key to the line of $key.pub, without the carriage return or
# the final newline an editor may have left or left out.
read_public_key() {
  ssh-keygen -l -f "$key.pub" >/dev/null 2>&1 || die "$key.pub holds no public key"
  IFS= read -r public_key <"$key.pub" || [[ -n $public_key ]]
  public_key=${public_key%$'\r'}
}

# BatchMode logins (this script's checks, launch.sh's) cannot ask for a
# passphrase: a key that has one must be in ssh-agent.
check_key_usable_without_prompt() {
  local blob error
  error=$(ssh-keygen -y -P '' -f "$key" 2>&1 >/dev/null) && return 0
  if [[ $error == *'bad permissions'* ]]; then # (ssh-add refuses it too)
    die "$key is open to other users, so ssh ignores it: chmod 600 $key"
  fi
  read -r _ blob _ <<<"$public_key"
  ssh-add -L 2>/dev/null | grep -qF " $blob" ||
    die "$key has a passphrase, and no ssh-agent holds it: run 'ssh-add $key' first"
}

# Sets cmd to ssh to host number $1 with the extra options "${@:2}".
ssh_for() {
  local i=$1
  shift
  # RemoteCommand=none: ssh refuses a command given beside one of
  # ~/.ssh/config's. ClearAllForwardings: a port forwarded there may be taken
  # by the user's own session.
  # LogLevel=INFO: ssh says why it failed even where the config says QUIET; a
  # Slurm node's refusal comes as a banner, which ssh shows only at INFO or above.
  cmd=("${ssh_command[@]}" -o ConnectTimeout=5 -o StrictHostKeyChecking=accept-new
    -o RemoteCommand=none -o ClearAllForwardings=yes -o LogLevel=INFO
    ${ports[i]:+-p "${ports[i]}"} "$@" "${destinations[i]}")
}

# Sets time_limit to the command that runs another for at most LOGIN_SECONDS
# (exit 124 past it), where there is a timeout program (not on macOS).
# --foreground: else ssh would run outside the terminal's foreground group,
# where Ctrl-C misses it and a bastion's prompt stops it.
choose_time_limit() {
  if timeout --foreground 1 true 2>/dev/null; then
    time_limit=(timeout --foreground "$LOGIN_SECONDS")
  elif command -v timeout >/dev/null; then # BusyBox's, which has no --foreground
    time_limit=(timeout "$LOGIN_SECONDS")
  fi
}

# Runs "$@" under time_limit.
within_limit() {
  "${time_limit[@]}" "$@"
}

# Runs `true` in BatchMode on host number $1, with the extra ssh options
# "${@:2}", and sets login_output to what ssh said. Returns ssh's status, or
# 124 where the host did not answer in time.
try_login() {
  local status=0
  ssh_for "$@" -o BatchMode=yes
  within_limit "${cmd[@]}" true </dev/null >"$ssh_output" 2>&1 || status=$?
  login_output=$(<"$ssh_output")
  return "$status"
}

# Adds the key on host number $1 with the key itself, or else, where the host
# refuses it, with a password. Any other failure (no route, a changed host
# key) is left for the table to report.
install_key() {
  local i=$1 install error status=0
  install=$(remote_bash_command "$INSTALL_KEY")
  # IdentitiesOnly: an agent's keys, offered first, would use up the host's
  # MaxAuthTries (6) before this one.
  ssh_for "$i" -i "$key" -o IdentitiesOnly=yes -o BatchMode=yes
  within_limit "${cmd[@]}" "$install" <<<"$public_key" 2>"$ssh_output" >/dev/null || status=$?
  error=$(<"$ssh_output")
  if ((status == 0)); then
    return 0
  elif ((status == 124)); then # the table says so
    return 124
  elif ((status != 255)); then # logged in, and the command failed (a read-only home, say)
    echo "setup_ssh.sh: ${labels[i]}: cannot add the key: $(tail -n 1 <<<"$error")" >&2
    return 1
  elif [[ $error != *"Permission denied"* ]]; then
    return 1
  fi
  echo "setup_ssh.sh: ${labels[i]}: installing $key.pub with a password login" >&2
  # No key: sshpass answers a password prompt, and a passphrase's would wait forever.
  ssh_for "$i" -o NumberOfPasswordPrompts=1 -o PubkeyAuthentication=no
  if [[ -n ${SSHPASS:-} ]] && command -v sshpass >/dev/null; then
    within_limit sshpass -e "${cmd[@]}" "$install" <<<"$public_key"
  else # a person types it: no time limit
    "${cmd[@]}" "$install" <<<"$public_key"
  fi
}

no_answer() {
  echo "FAILED: no answer within $LOGIN_SECONDS s (a login that hangs: a slow .bashrc, a" \
    "stale network mount?)"
}

# Prints "ok" or why BatchMode login to host number $1 failed, as launch.sh
# will log in (with the keys ssh offers by itself), from try_login's status $2
# and output $3; $4 is "installed" where this run has just added the key there.
login_result() {
  local i=$1 status=$2 output=$3 installed=$4 reason login_output
  if ((status == 0)); then
    echo ok
    return
  elif ((status == 124)); then
    no_answer
    return
  fi
  if [[ -e $key ]] && try_login "$i" -i "$key" -o IdentitiesOnly=yes; then
    if [[ $output == *'Too many authentication failures'* ]]; then
      echo "FAILED: works only with -i $key -o IdentitiesOnly=yes (ssh offers other keys" \
        "first, more than the host takes): add 'IdentityFile $key' and 'IdentitiesOnly yes'" \
        "for these hosts to ~/.ssh/config"
    else
      echo "FAILED: works only with -i $key: add 'IdentityFile $key' to ~/.ssh/config"
    fi
  elif [[ -n $installed && $login_output == *"Permission denied"* ]]; then
    echo "FAILED: Permission denied to the key just added: sshd there ignores" \
      "the ~/.ssh/authorized_keys that others may write to, or a directory above it (chmod" \
      "go-w ~ there), or reads keys from elsewhere (AuthorizedKeysFile)"
  else
    reason=$(reason_line "$output")
    echo "FAILED: ${reason:-ssh said nothing}$(changed_host_key_fix "$output")$(too_many_keys_fix "$output")"
  fi
}

main() {
  require_bash 4 4 # empty arrays under set -u
  # Ctrl-C stops the whole run, also where the ssh it interrupts exits 255 as if
  # refused (bash would go on to the next host).
  trap 'exit 130' INT
  local key=~/.ssh/id_ed25519 labels=() destinations=() ports=() local_node=()
  local ssh_command=() cmd=() public_key='' time_limit=() ssh_output
  local i width=4 result status failed=0 needs_key=() login_output
  local login_status=() login_outputs=() # each host's latest try_login
  local installed=()                      # "installed" where install_key succeeded
  while (($#)); do
    case $1 in
      -h | --help) usage; exit 0 ;;
      --key) (($# >= 2)) || die "--key needs a value"; key=$2; shift 2 ;;
      -*) die "unknown option: $1 (see --help)" ;;
      *) break ;;
    esac
  done
  (($# == 1)) || die "usage: setup_ssh.sh [--key PATH] HOSTFILE (see --help)"
  [[ $key != *.pub ]] || die "--key takes the private key, ${key%.pub}, not $key"
  read_hostfile "$1"
  drop_local_hosts
  if ((${#labels[@]} == 0)); then
    echo "setup_ssh.sh: every host in $1 is this machine, which needs no SSH: nothing to do"
    return 0
  fi
  read_ssh_command
  choose_time_limit
  # What ssh says goes through this file, not $(...): an ssh that shares a
  # ControlMaster's connection hands its output to the master, which holds it
  # open until the remote command ends (never, on a hung mount), and $(...)
  # would wait as long, past the time limit.
  ssh_output=$(mktemp) || die "cannot make a temporary file (in ${TMPDIR:-/tmp})"
  # shellcheck disable=SC2064 # expanded now: main's locals are gone at exit
  trap "rm -f -- ${ssh_output@Q}" EXIT
  if [[ -n ${SSHPASS:-} ]] && ! command -v sshpass >/dev/null; then
    echo "setup_ssh.sh: warning: SSHPASS is set, but sshpass is not installed: a host that" \
      "refuses the key asks for its password, and without a terminal fails" >&2
  fi

  # A host where BatchMode login works already (with a cluster's own id_rsa,
  # say) is left alone; only the hosts that refuse every key ssh offers need one.
  for i in "${!labels[@]}"; do
    status=0
    try_login "$i" || status=$?
    login_status[i]=$status login_outputs[i]=$login_output
    if ((status == 255)) && [[ $login_output == *"Permission denied"* ||
      $login_output == *"Too many authentication failures"* ]]; then
      needs_key+=("$i")
    fi
    ((${#labels[i]} <= width)) || width=${#labels[i]}
  done
  if ((${#needs_key[@]})); then
    if [[ -e $key ]]; then check_key; else create_key; fi
  fi
  for i in "${needs_key[@]}"; do
    status=0
    install_key "$i" || status=$? # the table below reports a failure
    if ((status == 0)); then installed[i]=installed; fi
    if ((status != 124)); then # see how the key left it
      status=0
      try_login "$i" || status=$?
    fi
    login_status[i]=$status login_outputs[i]=$login_output
  done
  printf '%-*s  %s\n' "$width" HOST "BATCHMODE LOGIN"
  for i in "${!labels[@]}"; do
    result=$(login_result "$i" "${login_status[i]}" "${login_outputs[i]}" "${installed[i]:-}")
    [[ $result == ok ]] || failed=1
    printf '%-*s  %s\n' "$width" "${labels[i]}" "$result"
  done
  return "$failed"
}

main "$@"
