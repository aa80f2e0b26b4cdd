#!/usr/bin/env bash
#
# Usage: setup_ssh.sh [--key PATH] HOSTFILE
#
# Makes password-less (BatchMode) SSH work from here to every host in
# HOSTFILE (the format of launch.sh: [user@]host[:port] per line, '#'
# comments). localhost and this machine's own name or addresses are skipped.
#
# 1. Creates the key (default: ~/.ssh/id_ed25519, no passphrase) if it is
#    missing; an existing key is never overwritten.
# 2. Adds its public key to ~/.ssh/authorized_keys on every host where it is
#    not there yet, under any comment (~/.ssh 700, the file 600). Only a host
#    that refuses the key is asked for a password: it comes from $SSHPASS
#    through `sshpass -e` when both are there, or is asked once per host.
#    New host keys are recorded with StrictHostKeyChecking=accept-new; a
#    changed host key stops that host.
# 3. Prints a table of whether BatchMode login works on each host, and exits 1
#    if it does not on any.
#
# Every ssh call runs $SSH_COMMAND (default: ssh), split on spaces, e.g.
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

create_key() {
  [[ $key != *.pub ]] || die "--key takes the private key, ${key%.pub}, not $key"
  if [[ -e $key ]]; then
    [[ -f $key.pub ]] || die "no $key.pub: --key takes a private key with its public key" \
      "beside it ('ssh-keygen -y -f $key > $key.pub' writes it)"
    return 0
  fi
  (umask 077 && mkdir -p "$(dirname -- "$key")")
  ssh-keygen -q -t ed25519 -N '' -C "setup_ssh.sh@$(uname -n)" -f "$key"
  echo "setup_ssh.sh: created $key" >&2
}

# Sets public_key to the line of $key.pub, without the carriage return or
# the final newline an editor may have left or left out.
read_public_key() {
  ssh-keygen -l -f "$key.pub" >/dev/null 2>&1 || die "$key.pub holds no public key"
  IFS= read -r public_key <"$key.pub" || [[ -n $public_key ]]
  public_key=${public_key%$'\r'}
}

# Sets cmd to ssh to host number $1 with the extra options "${@:2}".
ssh_for() {
  local i=$1
  shift
  # RemoteCommand=none: ssh refuses a command given beside one of
  # ~/.ssh/config's. ClearAllForwardings: a port forwarded there may be taken
  # by the user's own session.
  cmd=("${ssh_command[@]}" -o ConnectTimeout=5 -o StrictHostKeyChecking=accept-new
    -o RemoteCommand=none -o ClearAllForwardings=yes ${ports[i]:+-p "${ports[i]}"} "$@"
    "${destinations[i]}")
}

# Adds the key on host number $1 with the key itself, or else, where the host
# refuses it, with a password. Any other failure (no route, a changed host
# key) is left for the table to report.
install_key() {
  local i=$1 install error status=0
  install=$(remote_bash_command "$INSTALL_KEY")
  ssh_for "$i" -i "$key" -o BatchMode=yes
  error=$("${cmd[@]}" "$install" <<<"$public_key" 2>&1 >/dev/null) || status=$?
  if ((status == 0)); then
    return 0
  elif ((status != 255)); then # logged in, and the command failed (a read-only home, say)
    echo "setup_ssh.sh: ${labels[i]}: cannot add the key: $(tail -n 1 <<<"$error")" >&2
    return 1
  elif [[ $error != *"Permission denied"* ]]; then
    return 1
  fi
  echo "setup_ssh.sh: ${labels[i]}: installing $key.pub with a password login" >&2
  ssh_for "$i" -o NumberOfPasswordPrompts=1
  if [[ -n ${SSHPASS:-} ]] && command -v sshpass >/dev/null; then
    cmd=(sshpass -e "${cmd[@]}")
  fi
  "${cmd[@]}" "$install" <<<"$public_key"
}

# Prints "ok" or why BatchMode login to host number $1 fails, as launch.sh
# will log in: with the keys ssh offers by itself.
check_login() {
  local i=$1 output
  ssh_for "$i" -o BatchMode=yes
  if output=$("${cmd[@]}" true 2>&1 </dev/null); then
    echo ok
    return
  fi
  ssh_for "$i" -i "$key" -o BatchMode=yes
  if "${cmd[@]}" true >/dev/null 2>&1 </dev/null; then
    echo "FAILED: works only with -i $key: add 'IdentityFile $key' to ~/.ssh/config"
  else
    echo "FAILED: $(tail -n 1 <<<"$output")"
  fi
}

main() {
  require_bash 4 4 # empty arrays under set -u
  local key=~/.ssh/id_ed25519 labels=() destinations=() ports=() local_node=()
  local ssh_command=() cmd=() public_key
  local i width=4 result failed=0
  while (($#)); do
    case $1 in
      -h | --help) usage; exit 0 ;;
      --key) (($# >= 2)) || die "--key needs a value"; key=$2; shift 2 ;;
      -*) die "unknown option: $1 (see --help)" ;;
      *) break ;;
    esac
  done
  (($# == 1)) || die "usage: setup_ssh.sh [--key PATH] HOSTFILE (see --help)"
  read_hostfile "$1"
  drop_local_hosts
  if ((${#labels[@]} == 0)); then
    echo "setup_ssh.sh: every host in $1 is this machine, which needs no SSH: nothing to do"
    return 0
  fi
  read -ra ssh_command <<<"${SSH_COMMAND:-ssh}"
  create_key
  read_public_key

  for i in "${!labels[@]}"; do
    install_key "$i" || true # the table below reports it
    ((${#labels[i]} <= width)) || width=${#labels[i]}
  done
  printf '%-*s  %s\n' "$width" HOST "BATCHMODE LOGIN"
  for i in "${!labels[@]}"; do
    result=$(check_login "$i")
    [[ $result == ok ]] || failed=1
    printf '%-*s  %s\n' "$width" "${labels[i]}" "$result"
  done
  return "$failed"
}

main "$@"
