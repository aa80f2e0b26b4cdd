#!/usr/bin/env bash
#
# Usage: setup_ssh.sh [--key PATH] HOSTFILE
#
# Makes password-less (BatchMode) SSH work from here to every host of HOSTFILE,
# launch.sh's hosts file; this machine's own names are skipped.
#  1. A host where BatchMode login works already is left alone.
#  2. The key (default: ~/.ssh/id_ed25519, no passphrase) is created if a host needs
#     it and it is missing; an existing key is never overwritten. A new one named
#     id_ecdsa or id_rsa is of that type (FIPS mode refuses ed25519).
#  3. Its public key is added to ~/.ssh/authorized_keys on the hosts that refuse it,
#     unless there already, with a password login: from $SSHPASS through `sshpass -e`
#     where both are there, else asked. New host keys are recorded (accept-new); a
#     changed one stops that host. A key with a passphrase must be in ssh-agent.
#  4. A table says whether BatchMode login works on each host; exit 1 if not on all.
#     A login that takes over 30 s is given up.
# SSH_COMMAND (default: ssh) runs every ssh call, e.g. SSH_COMMAND='ssh -F cluster.conf'.
#
# Options:
#   --key PATH  private key to use (default: ~/.ssh/id_ed25519)
#   -h, --help  show this help

if [ -z "${BASH_VERSION:-}" ] || shopt -oq posix; then
  echo "setup_ssh.sh: run it with bash, not sh" >&2
  exit 2
fi
set -euo pipefail

THIS_FILE=$(readlink -f -- "${BASH_SOURCE[0]}") # lib/ is beside the real file, not a symlink
# shellcheck source=lib/hosts.sh
source "${THIS_FILE%/*}/lib/hosts.sh"

readonly LOGIN_SECONDS=30
# Runs on each host: appends the public key read from stdin to ~/.ssh/authorized_keys,
# unless there under any comment or options, on a line of its own.
# shellcheck disable=SC2016 # expanded there
readonly INSTALL_KEY='umask 077 && read -r key && read -r _ blob _ <<<"$key" && [[ -n $blob ]] &&
mkdir -p ~/.ssh && chmod 700 ~/.ssh && keys=~/.ssh/authorized_keys &&
{ awk -v blob="$blob" "!/^[[:space:]]*#/ { for (i = 1; i <= NF; i++) if (\$i == blob) found = 1 }
  END { exit !found }" "$keys" 2>/dev/null ||
{ if [[ -s $keys && -n $(tail -c 1 "$keys") ]]; then echo; fi; echo "$key"; } >>"$keys"; } &&
chmod 600 "$keys"'

die() {
  echo "setup_ssh.sh: $*" >&2
  exit 2
}

# Sets public_key; dies unless $key is a private key usable in BatchMode, with its .pub.
check_key() {
  local blob error
  [[ -f $key.pub ]] || die "no $key.pub: --key takes a private key with its public key beside it" \
    "('ssh-keygen -y -f $key > $key.pub' writes it)"
  read_public_key
  error=$(ssh-keygen -y -P '' -f "$key" 2>&1 >/dev/null) && return 0
  [[ $error != *'bad permissions'* ]] || die "$key is open to other users, so ssh ignores it: chmod 600 $key"
  read -r _ blob _ <<<"$public_key"
  ssh-add -L 2>/dev/null | grep -qF " $blob" \
    || die "$key has a passphrase, and no ssh-agent holds it: run 'ssh-add $key' first"
}

create_key() {
  local type=ed25519
  case ${key##*/} in
    id_ecdsa) type=ecdsa ;;
    id_rsa) type=rsa ;;
  esac
  (umask 077 && mkdir -p "$(dirname -- "$key")")
  ssh-keygen -q -t "$type" -N '' -C "setup_ssh.sh@$(uname -n)" -f "$key" </dev/null \
    || die "ssh-keygen cannot make a $type key $key (in FIPS mode, --key ~/.ssh/id_ecdsa makes an ECDSA one)"
  echo "setup_ssh.sh: created $key" >&2
  read_public_key
}

# Sets public_key to $key.pub's line, without an editor's \r.
read_public_key() {
  ssh-keygen -l -f "$key.pub" >/dev/null 2>&1 || die "$key.pub holds no public key"
  IFS= read -r public_key <"$key.pub" || [[ -n $public_key ]]
  public_key=${public_key%$'\r'}
}

# Runs ssh to host number $1, with the extra arguments "${@:2}" after the host, under
# time_limit, its output in $ssh_output: not $(...), which an ssh through a ControlMaster
# would hold open as long as the login hangs.
ssh_to() {
  local i=$1
  shift
  "${time_limit[@]}" "${ssh_command[@]}" -o StrictHostKeyChecking=accept-new -o LogLevel=INFO \
    ${ports[i]:+-p "${ports[i]}"} "${destinations[i]}" "$@" >"$ssh_output" 2>&1
}

# Tries a BatchMode login to host number $1 with the extra options "${@:2}".
try_login() {
  local i=$1
  shift
  ssh_to "$i" -o BatchMode=yes "$@" true </dev/null
}

# Adds the key on host number $1: with the key itself where it works, else with a
# password. Any other failure (no route, a changed host key) is left for the table.
install_key() {
  local i=$1 install status=0
  install=$(remote_bash_command "$INSTALL_KEY")
  # IdentitiesOnly: an agent's keys, offered first, would use up the host's MaxAuthTries.
  ssh_to "$i" -i "$key" -o IdentitiesOnly=yes -o BatchMode=yes "$install" <<<"$public_key" || status=$?
  if ((status == 0 || status == 124)); then
    return "$status"
  elif ((status != 255)); then # logged in, and the command failed (a read-only home, say)
    echo "setup_ssh.sh: ${labels[i]}: cannot add the key: $(tail -n 1 "$ssh_output")" >&2
    return 1
  fi
  grep -q 'Permission denied' "$ssh_output" || return 1
  echo "setup_ssh.sh: ${labels[i]}: installing $key.pub with a password login" >&2
  # No key: sshpass answers a password prompt, and a passphrase's would wait for ever.
  local time_limit=() # a person types it
  if [[ -n ${SSHPASS:-} ]] && command -v sshpass >/dev/null; then
    time_limit=(timeout --foreground "$LOGIN_SECONDS" sshpass -e)
  fi
  ssh_to "$i" -o NumberOfPasswordPrompts=1 -o PubkeyAuthentication=no "$install" <<<"$public_key"
}

# Prints "ok" or why BatchMode login to host number $1 fails, from try_login's status $2
# and output $3; $4 is "installed" where this run added the key there.
login_result() {
  local i=$1 status=$2 output=$3 installed=$4
  if ((status == 0)); then
    echo ok
  elif ((status == 124)); then
    echo "FAILED: no answer within $LOGIN_SECONDS s (a login that hangs: a slow .bashrc, a stale network mount?)"
  elif [[ -e $key ]] && try_login "$i" -i "$key" -o IdentitiesOnly=yes; then
    echo "FAILED: works only with -i $key -o IdentitiesOnly=yes: add 'IdentityFile $key' and" \
      "'IdentitiesOnly yes' for these hosts to ~/.ssh/config"
  elif [[ -n $installed ]] && grep -q 'Permission denied' "$ssh_output"; then
    echo "FAILED: Permission denied to the key just added: sshd there ignores an authorized_keys" \
      "that others may write to, or a directory above it (chmod go-w ~ there), or reads keys elsewhere"
  else
    echo "FAILED: $(ssh_failure "$output")"
  fi
}

# Logs in to every host, installs the key where it is needed, prints the table.
setup_hosts() {
  local ssh_output i status result failed=0 width=4 needs_key=() statuses=() outputs=() installed=()
  read_ssh_command
  ssh_output=$(mktemp) || die "cannot make a temporary file (in ${TMPDIR:-/tmp})"
  # shellcheck disable=SC2064 # expanded now: the locals are gone at exit
  trap "rm -f -- ${ssh_output@Q}" EXIT
  if [[ -n ${SSHPASS:-} ]] && ! command -v sshpass >/dev/null; then
    echo "setup_ssh.sh: warning: SSHPASS is set, but sshpass is not installed: a password is asked" >&2
  fi
  for i in "${!labels[@]}"; do
    status=0
    try_login "$i" || status=$?
    statuses[i]=$status outputs[i]=$(<"$ssh_output")
    if ((status == 255)) && [[ ${outputs[i]} == *'Permission denied'* || ${outputs[i]} == *'Too many auth'* ]]; then
      needs_key+=("$i")
    fi
    ((${#labels[i]} <= width)) || width=${#labels[i]}
  done
  if ((${#needs_key[@]})); then
    [[ -e $key || ! -e $key.pub ]] || die "$key.pub has no private key $key beside it: give --key"
    if [[ -e $key ]]; then check_key; else create_key; fi
  fi
  for i in "${needs_key[@]}"; do
    status=0
    install_key "$i" || status=$?
    if ((status == 0)); then installed[i]=installed; fi
    if ((status != 124)); then # see how the key left it
      status=0
      try_login "$i" || status=$?
    fi
    statuses[i]=$status outputs[i]=$(<"$ssh_output")
  done
  printf '%-*s  %s\n' "$width" HOST "BATCHMODE LOGIN"
  for i in "${!labels[@]}"; do
    result=$(login_result "$i" "${statuses[i]}" "${outputs[i]}" "${installed[i]:-}")
    [[ $result == ok ]] || failed=1
    printf '%-*s  %s\n' "$width" "${labels[i]}" "$result"
  done
  return "$failed"
}

main() {
  ((BASH_VERSINFO[0] * 100 + BASH_VERSINFO[1] >= 404)) || die "needs bash 4.4 or newer (this is $BASH_VERSION)"
  # Ctrl-C stops the whole run, also where the ssh it interrupts exits 255 as if refused.
  trap 'exit 130' INT
  local key=~/.ssh/id_ed25519 labels=() destinations=() ports=() local_node=() ssh_command=()
  local public_key='' i
  # --foreground: Ctrl-C must reach ssh, and a bastion's prompt must not stop it.
  local time_limit=(timeout --foreground "$LOGIN_SECONDS")
  while (($#)); do
    case $1 in
      -h | --help) sed -n '3,/^$/s/^# \{0,1\}//p' "$THIS_FILE"; exit 0 ;;
      --key) (($# >= 2)) || die "--key needs a value"; key=$2; shift 2 ;;
      -*) die "unknown option: $1 (see --help)" ;;
      *) break ;;
    esac
  done
  (($# == 1)) || die "missing HOSTFILE: setup_ssh.sh [--key PATH] HOSTFILE"
  [[ $key != *.pub ]] || die "--key takes the private key, ${key%.pub}, not $key"
  read_hostfile "$1"
  for i in "${!labels[@]}"; do
    [[ -z ${local_node[i]} ]] || unset 'labels[i]'
  done
  if ((${#labels[@]} == 0)); then
    echo "setup_ssh.sh: every host in $1 is this machine, which needs no SSH: nothing to do"
    return 0
  fi
  setup_hosts
}

main "$@"
