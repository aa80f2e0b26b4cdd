#!/usr/bin/env bash
#
# Usage: launch.sh [options] HOSTFILE NPROC_PER_NODE [SCRIPT [ARGS...]]
#
# Runs SCRIPT (default: train.py) under torchrun on every host in HOSTFILE,
# over SSH, with NPROC_PER_NODE processes on each (a number, or torchrun's
# auto, gpu or cpu), and waits for it. ARGS go to SCRIPT untouched, e.g.
#   ./launch.sh hosts.txt 4 train.py --epochs 5 --checkpoint-dir checkpoints
#
# HOSTFILE has one host per line, [user@]host[:port]; '#' starts a comment.
# The first host serves the rendezvous, on a free port there. localhost and
# this machine's own name or addresses (written without user or port) run
# here without SSH. Node ranks come from torchrun's c10d rendezvous and do
# not necessarily follow line order.
#
# Options, before HOSTFILE (after SCRIPT, they are SCRIPT's):
#   --max-restarts N  restart the job on all hosts up to N times after a
#                     worker fails, not a host lost (default: 0)
#   --torchrun PATH   torchrun to run on every host (default: the one on this
#                     machine's PATH, at the same absolute path)
#   --workdir DIR     directory to run in on every host (default: this one;
#                     a relative DIR is taken from this one)
#   --env-file FILE   KEY=VALUE lines to set on every host, taken as written
#                     (no $VAR expansion, no quote removal: it warns of either)
#   --port PORT       rendezvous port on the first host (default: a free one)
#   --log-dir DIR     write each host's log to DIR/<job-id>/ (default: logs)
#   --dry-run         check the hosts, print each host's command, start nothing
#   -h, --help        show this help
#
# First every host is checked, with the job's environment, the first alone
# for up to 5 s and then the others in parallel (so that a ControlMaster the
# first check opens, to a bastion say, serves them all), these within 30 s:
# SSH, bash 4.3+, the directory, torchrun, a Python 3 (torchrun's, else
# python3), the script, a GPU where NPROC_PER_NODE is gpu, the interfaces
# that GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME name (where sent or set
# there), that the address SSH reached it at is one the other hosts can use
# (not another host's, nor this machine's where a host runs here, nor
# 127.0.0.1 where there are others),
# that the hosts' clocks agree (within 4 s for certain, which catches 10 s),
# and on the first host that --port is free. If any check fails, nothing
# starts.
# Then each host but the first, as it starts, tries the rendezvous port, and
# fails within 15 s if a firewall drops the packets (says so after 30 s if
# the port refuses them).
#
# Every host gets NCCL_*, GLOO_*, TORCH_*, OMP_NUM_THREADS,
# CUDA_VISIBLE_DEVICES and PYTHONPATH from this environment, plus the
# --env-file lines, through SSH's standard input: no value shows in `ps`.
# (A local one also has the rest of this environment.)
# GLOO_SOCKET_IFNAME, unless set there or sent, is the interface of the
# host's address (none where that is lo: gloo then goes by the host's name).
#
# Every ssh call runs $SSH_COMMAND (unset or blank: ssh), split on spaces, e.g.
# SSH_COMMAND='ssh -F ./cluster_ssh_config'.
#
# If a host fails, the others are stopped and launch.sh exits 1. Ctrl-C,
# SIGTERM or SIGHUP (its terminal closed) stops the job everywhere (exit
# 130, 143 or 129). A second one, or 30 s of stopping that some host has not
# finished, ends the wait: launch.sh says which hosts it left, where part of
# the job may run on. If launch.sh dies, each host stops its part of the job
# as soon as its SSH input closes; cut off from launch.sh by the network, or
# with launch.sh stopped (Ctrl-Z), after 30 s without a word from it.

if [ -z "${BASH_VERSION:-}" ] || shopt -oq posix; then # sh launch.sh: not bash, or bash as sh
  echo "launch.sh: run it with bash, not sh" >&2
  exit 2
fi
set -euo pipefail

# Through a symlink (~/bin/launch.sh, say), lib/ is beside the real file. BSD
# readlink before macOS 12.3 has no -f: then the path it was called by.
THIS_FILE=$(readlink -f -- "${BASH_SOURCE[0]}" 2>/dev/null) || THIS_FILE=${BASH_SOURCE[0]}
# shellcheck source=lib/hosts.sh
source "$(dirname -- "$THIS_FILE")/lib/hosts.sh"
# shellcheck source=lib/node.sh
source "$(dirname -- "$THIS_FILE")/lib/node.sh"

readonly FORWARDED='^(NCCL_.*|GLOO_.*|TORCH_.*|OMP_NUM_THREADS|CUDA_VISIBLE_DEVICES|PYTHONPATH)$'
# -T: no terminal even where ~/.ssh/config forces one (RequestTTY force),
# which would end every line of output in \r. RemoteCommand=none: ssh
# refuses a command given beside one of the config's (tmux, say).
# ClearAllForwardings: a port forwarded there (for Jupyter, say) is taken
# already when the user's own session holds it, which fails every
# connection under ExitOnForwardFailure.
readonly SSH_OPTIONS=(-T -o BatchMode=yes -o ConnectTimeout=5 -o ServerAliveInterval=5
  -o ServerAliveCountMax=3 -o RemoteCommand=none -o ClearAllForwardings=yes)
readonly PREFLIGHT_SECONDS=30 # for a host's whole check: a hung login or mount must not hang here
# torchrun's rendezvous compares each host's heartbeats, stamped by its own
# clock, with its own clock, and takes a host whose last one looks 15 s old
# for gone (they come every 5 s): hosts whose clocks are this far apart for
# certain fail preflight. Its clocks count whole seconds, so where checks
# take under a second, any 10 s apart are.
readonly CLOCK_SKEW_SECONDS=4
# The first host's check runs alone for up to FIRST_ALONE_SECONDS. Its ssh may
# open a ControlMaster (to a bastion, say) that every later ssh call then
# shares; started all at once, each would open a connection of its own, and
# more than 10 at a time exceed sshd's default MaxStartups, which drops some.
readonly FIRST_ALONE_SECONDS=5
# While the job runs, this script writes a NUL to every host's stdin every
# HEARTBEAT_SECONDS. A host that hears nothing for SILENCE_SECONDS takes
# this script for gone, as when its stdin closes: a network cut off without
# a reset closes no connection, and the host's sshd would never notice.
readonly HEARTBEAT_SECONDS=5 SILENCE_SECONDS=30
# A host stops its part in 6 s at most (its workers get 5 s), and ssh gives up
# on a host that stopped answering after 15 s. One still busy after
# STOP_SECONDS is stuck (its clean-up on a hung mount, say): this script
# leaves it rather than wait for ever.
readonly STOP_SECONDS=30
# This script also counts time in polls, each a read -t of POLL_SECONDS,
# whose length no step of the wall clock changes. Bash's SECONDS follows the
# wall clock: stepped back by NTP, it would hold the heartbeat back as long.
readonly POLL_SECONDS=0.2 POLLS_PER_SECOND=5
# SCRIPT's arguments reach each host quoted and base64-encoded, in the one
# argument of its login shell's -c, which Linux caps at 128 KiB.
readonly MAX_ARGS_BYTES=65536

# Prints $1 with a leading ~ made this user's home: the shell expands the ~ of
# --workdir ~/x, not that of --workdir=~/x.
expand_tilde() {
  case $1 in
    \~ | \~/*) printf '%s\n' "$HOME${1#\~}" ;;
    *) printf '%s\n' "$1" ;;
  esac
}

usage() {
  sed -n '3,/^$/s/^# \{0,1\}//p' "$0"
}

die() {
  echo "launch.sh: $*" >&2
  exit 2
}

# Sets cmd to run function $2 with arguments "${@:3}" on host number $1.
build_command() {
  local i=$1 function=$2 source log_level=ERROR
  shift 2
  source="$(declare -f torchrun_python "$function"); $function \"\$@\""
  # ssh's LogLevel: INFO for the checks, where ssh says why it failed even if
  # the config says QUIET (a Slurm node's refusal is a banner, which ssh shows
  # only at INFO or above); ERROR for the job, whose output is the job's: no
  # site's login banner on each host's first line (launch.sh itself says when
  # ssh lost a host).
  if [[ $function == check_node ]]; then log_level=INFO; fi
  if [[ -n ${local_node[i]} ]]; then
    cmd=(bash -c "$source" launch.sh "$@")
  else
    cmd=("${ssh_command[@]}" "${SSH_OPTIONS[@]}" -o LogLevel="$log_level" ${ports[i]:+-p "${ports[i]}"}
      "${destinations[i]}" "$(remote_bash_command "$source" "$@")")
  fi
  # In a session of its own, out of reach of a signal to the whole group (a
  # terminal's Ctrl-C), which this script answers by stopping the host. Some
  # programs catch it even where it is ignored: an ssh client that shares a
  # ControlMaster's connection would end, and leave the host's job running; a
  # local node's torchrun would pass it on to its workers, each of which
  # would print a KeyboardInterrupt traceback. Without a terminal, as the job
  # has it, from preflight on. (macOS has no setsid.)
  if command -v setsid >/dev/null; then cmd=(setsid "${cmd[@]}"); fi
}

# Fills env_entries with what every host gets in its environment.
collect_env() {
  local name line value n=0
  env_entries=(TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1) # a fresh store per restart round
  while IFS= read -r name; do
    if [[ $name =~ $FORWARDED ]]; then env_entries+=("$name=${!name}"); fi
  done < <(compgen -e)
  if [[ -n $env_file ]]; then
    require_readable_file "$env_file"
    while IFS= read -r line || [[ -n $line ]]; do
      n=$((n + 1))
      ((n > 1)) || line=${line#$'\xef\xbb\xbf'} # written on Windows: a byte-order mark,
      line=${line%$'\r'}                         # and CRLF
      [[ $(trim "$line") =~ ^(#|$) ]] && continue
      [[ $line =~ ^[A-Za-z_][A-Za-z0-9_]*= ]] \
        || die "$env_file:$n: not KEY=VALUE (no export, no spaces around =): ${line%%=*}" # (no value)
      value=${line#*=}
      if [[ $value == *'$'* || $value == \"*\" || $value == \'*\' ]]; then # as a shell's .env has them
        echo "launch.sh: warning: $env_file:$n: ${line%%=*} gets its value as written, quotes and \$ included" >&2
      fi
      env_entries+=("$line")
    done <"$env_file"
  fi
}

# Prints the value env_entries gives variable $1, or "-" where none does.
sent_value() {
  local entry value=-
  for entry in "${env_entries[@]}"; do
    if [[ $entry == "$1"=* ]]; then value=${entry#*=}; fi
  done
  echo "$value"
}

# Sleeps POLL_SECONDS in this shell. The program sleep would put this
# script's traps off until it ended, and hold the hosts' pipes open meanwhile.
poll_pause() {
  read -r -t "$POLL_SECONDS" -u "$idle_fd" _ || true # nothing ever writes to it
}

# Starts check_node on host number $1, into $tmp/preflight.$1 (run_checks sets
# gloo_sent and nccl_sent).
start_check() {
  local node_port=-
  if (($1 == 0)); then node_port=${port:-free}; fi
  build_command "$1" check_node "$workdir" "$torchrun" "$script" "$node_port" "$gloo_sent" "$nccl_sent" "$nproc"
  printf -v "check_started[$1]" '%(%s)T' -1
  # (Through a pipe, not <(...): that printf would be a child of the command,
  # which never reaps it.)
  printf '%s\0' "${env_entries[@]}" '' | "${cmd[@]}" >"$tmp/preflight.$1" 2>&1 &
  pending[$!]=$1
}

# Runs check_node on every host: the first, then (once it has answered, or
# after FIRST_ALONE_SECONDS) the others in parallel. Cuts off the hosts that
# have not answered PREFLIGHT_SECONDS after the others started and marks them
# in timed_out.
run_checks() {
  local i pid polls=0 others_started_at='' gloo_sent nccl_sent
  local -A pending=() # pid -> host number
  gloo_sent=$(sent_value GLOO_SOCKET_IFNAME) nccl_sent=$(sent_value NCCL_SOCKET_IFNAME) # for start_check
  trap 'stop_checks 129' HUP
  trap 'stop_checks 130' INT
  trap 'stop_checks 143' TERM
  start_check 0
  while :; do
    for pid in "${!pending[@]}"; do
      if kill -0 "$pid" 2>/dev/null; then continue; fi
      printf -v "check_ended[${pending[$pid]}]" '%(%s)T' -1
      unset "pending[$pid]"
    done
    if [[ -z $others_started_at ]] \
      && ((${#pending[@]} == 0 || polls == FIRST_ALONE_SECONDS * POLLS_PER_SECOND)); then
      for ((i = 1; i < ${#labels[@]}; i++)); do start_check "$i"; done
      others_started_at=$polls
    fi
    if ((${#pending[@]} == 0
      || polls == others_started_at + PREFLIGHT_SECONDS * POLLS_PER_SECOND)); then break; fi
    poll_pause
    polls=$((polls + 1))
  done
  if ((${#pending[@]})); then
    for pid in "${!pending[@]}"; do timed_out[${pending[$pid]}]=yes; done
    kill -s KILL "${!pending[@]}" 2>/dev/null || true # a hung check may ignore TERM
    wait "${!pending[@]}" 2>/dev/null || true # (no "Killed" notice)
  fi
  trap - HUP INT TERM
}

# On a signal during preflight: kills run_checks' pending checks and exits $1.
stop_checks() {
  # || true: a check may be gone already (a signal to the whole group), or the
  # terminal (SIGHUP), and set -e would end this script with 1 before the exit.
  kill "${!pending[@]}" 2>/dev/null || true
  echo "launch.sh: stopped during preflight, nothing was started" >&2 || true
  exit "$1"
}

# Prints why the address remote host number $1 reports cannot serve the job,
# if it cannot. seen maps the addresses of the hosts before it to their numbers;
# here is the label of the host that runs here, if one does.
address_problem() {
  local address=${addresses[$1]} other
  case $address in
    -) echo "its sshd sets no SSH_CONNECTION, so its address is unknown" ;;
    127.* | ::1) # where there are other hosts, which cannot reach it there
      if ((${#labels[@]} > 1)); then
        echo "reached at $address (a tunnel?): list it by an address the other hosts can reach"
      fi
      ;;
    *)
      if [[ -n ${seen[$address]:-} ]]; then
        other=${labels[${seen[$address]}]}
        echo "reached at $address, as $other is (one machine under two names? containers behind one" \
          "address?): every host needs its own address"
      elif [[ -n $here && $(address_held_here "$address") == yes ]]; then
        echo "reached at $address, this machine's, which runs $here already (one machine under two" \
          "names?): list it once"
      fi
      ;;
  esac
}

# Prints whether this machine holds address $1 (secondary and loopback
# addresses included): yes, no, or unknown where it cannot tell.
address_held_here() {
  local address=${1#::ffff:} found
  if found=$(ip -o addr show to "$address" 2>/dev/null); then
    : # one line if it does
  elif found=$(hostname -I 2>/dev/null); then
    [[ " $found " == *" $address "* ]] || found=''
  else
    echo unknown
    return
  fi
  if [[ -n $found ]]; then echo yes; else echo no; fi
}

# Whether the clocks of hosts number $1 and $2 are CLOCK_SKEW_SECONDS apart
# or more for certain. Each host's clock minus this machine's lies between
# clock_low and clock_high (exclusive).
clocks_apart() {
  ((clock_low[$1] - clock_high[$2] >= CLOCK_SKEW_SECONDS
    || clock_low[$2] - clock_high[$1] >= CLOCK_SKEW_SECONDS))
}

# Prints how far host number $1's clock is from host number $2's.
clock_problem() {
  local difference way='ahead of'
  difference=$(((clock_low[$1] + clock_high[$1] - clock_low[$2] - clock_high[$2]) / 2))
  if ((difference < 0)); then difference=$((-difference)) way=behind; fi
  echo "its clock is about $difference s $way ${labels[$2]}'s, and torchrun's rendezvous, which" \
    "compares the hosts' clocks, drops a host at 15 s off or less: sync them (NTP: chrony," \
    "systemd-timesyncd)"
}

# Adds to reports each host whose clock is apart from the reference's or,
# where none is, the one most ahead, if it is apart from the one most behind.
# The reference is the clock that agrees with the most others' (the first
# host's, where they tie), so that one odd clock, the first host's too, is
# named alone.
add_clock_problems() {
  local i j agreeing most=0 reference='' ahead behind found=''
  for i in "${!clock_low[@]}"; do
    agreeing=0
    for j in "${!clock_low[@]}"; do
      if ! clocks_apart "$i" "$j"; then agreeing=$((agreeing + 1)); fi
    done
    if ((agreeing > most)); then most=$agreeing reference=$i; fi
  done
  [[ -n $reference ]] || return 0
  ahead=$reference behind=$reference
  for i in "${!clock_low[@]}"; do
    if clocks_apart "$i" "$reference"; then
      reports[i]=${reports[i]:-$(clock_problem "$i" "$reference")}
      found=yes
    fi
    if ((clock_low[i] > clock_low[ahead])); then ahead=$i; fi
    if ((clock_high[i] < clock_high[behind])); then behind=$i; fi
  done
  if [[ -z $found ]] && clocks_apart "$ahead" "$behind"; then
    reports[ahead]=${reports[ahead]:-$(clock_problem "$ahead" "$behind")}
  fi
}

# Prints what fixes ssh's refusal $2 of host $1, in parentheses, or nothing.
ssh_refusal_fix() {
  local i=$1 report=$2 setup_ssh changed
  setup_ssh=$(quote_words "$(dirname -- "$THIS_FILE")/setup_ssh.sh" "$hostfile")
  case $report in
    *'Permission denied ('*)
      echo " ($setup_ssh installs your key; one with a passphrase needs ssh-add first)"
      ;;
    'Access denied'*'active jobs'*) # Slurm's pam_slurm_adopt, or pam_slurm
      echo " (Slurm lets in only users with a job there: run launch.sh in an allocation of these hosts)"
      ;;
    'Host key verification failed.')
      changed=$(changed_host_key_fix "$(<"$tmp/preflight.$i")")
      if [[ -z $changed ]]; then changed=" ($setup_ssh records a new host's key)"; fi
      echo "$changed"
      ;;
    *) too_many_keys_fix "$report" ;;
  esac
}

# Checks every host; fills addresses and port, or prints a table of the hosts
# that failed and exits 1.
preflight() {
  local i report fields client='' here='' timed_out=() reports=() check_started=() check_ended=()
  local clock_low=() clock_high=()
  local -A seen=() # address -> host number
  for i in "${!labels[@]}"; do
    if [[ -n ${local_node[i]} ]]; then here=${labels[i]}; fi
  done
  run_checks
  for i in "${!labels[@]}"; do
    report=$(grep '^ok ' "$tmp/preflight.$i" | tail -n 1) || true
    if [[ -n ${timed_out[i]:-} && -n $report ]]; then
      reports[i]="its check passed, but its SSH session did not end within $PREFLIGHT_SECONDS s: a"
      reports[i]+=" program that a login script starts in the background holds the session's"
      reports[i]+=" output (start it with >/dev/null 2>&1)"
    elif [[ -n ${timed_out[i]:-} ]]; then
      reports[i]="no answer within $PREFLIGHT_SECONDS s"
    elif [[ -z $report ]]; then
      report=$(reason_line "$(<"$tmp/preflight.$i")")
      report=${report#fail: }
      reports[i]=${report:-ssh said nothing}$(ssh_refusal_fix "$i" "$report")
    else
      read -ra fields <<<"$report"
      addresses[i]=${fields[3]}
      # Its clock, read between the check's start and end here, all in whole
      # seconds (a number: it goes through arithmetic, which runs $(...) in it).
      if [[ ${fields[6]} =~ ^[0-9]+$ ]]; then
        clock_low[i]=$((fields[6] - check_ended[i] - 1)) clock_high[i]=$((fields[6] - check_started[i] + 1))
      fi
      if [[ ${fields[5]} != - ]]; then port=${fields[5]}; fi
      if [[ -z ${local_node[i]} ]]; then
        client=${client:-${fields[1]}} # this machine, as the hosts see it
        report=$(address_problem "$i")
        if [[ -n $report ]]; then reports[i]=$report; fi
        seen[${addresses[i]}]=$i
      fi
    fi
  done
  add_clock_problems
  if [[ -n $client && $(address_held_here "$client") == no ]]; then
    for i in "${!labels[@]}"; do
      if [[ -n ${local_node[i]} && -z ${reports[i]:-} ]]; then
        reports[i]="the other hosts see this machine as $client, which it does not hold (NAT or a jump host?): they cannot reach it there"
      fi
    done
  fi
  if ((${#reports[@]})); then
    echo "launch.sh: preflight failed, nothing was started:" >&2
    for i in "${!reports[@]}"; do
      printf '  %-*s  %s\n' "$label_width" "${labels[i]}" "${reports[i]}" >&2
    done
    exit 1
  fi
  for i in "${!labels[@]}"; do
    if [[ -n ${local_node[i]} ]]; then addresses[i]=${client:-127.0.0.1}; fi
  done
}

# Sets node_args to torchrun's arguments for host number $1, and rendezvous
# to the first host's ADDRESS:PORT.
set_node_args() {
  local i=$1 is_host=0 host=${addresses[0]}
  if ((i == 0)); then is_host=1; fi
  [[ $host != *:* ]] || host="[$host]" # IPv6
  rendezvous=$host:$port
  node_args=(--nnodes="${#labels[@]}" --nproc-per-node="$nproc"
    --rdzv-backend=c10d --rdzv-endpoint="$rendezvous"
    --rdzv-id="$job_id" --rdzv-conf="is_host=$is_host"
    --max-restarts="$max_restarts" --local-addr="${addresses[i]}"
    "$script" "${script_args[@]}")
}

print_dry_run() {
  local i how rendezvous names=()
  for i in "${!env_entries[@]}"; do names+=("${env_entries[i]%%=*}"); done
  echo "environment on every host (a local one also has the rest of this shell's): ${names[*]}"
  for i in "${!labels[@]}"; do
    set_node_args "$i"
    how="ssh ${ports[i]:+-p ${ports[i]} }${destinations[i]}"
    if [[ -n ${local_node[i]} ]]; then how=local; fi
    echo "${labels[i]} ($how): cd $(quote_words "$workdir") && $(quote_words "$torchrun" "${node_args[@]}")"
  done
}

# Reads on whatever becomes of its output (a full disk, a reader gone as with
# `| head`): the job must not die of it, and the log has every line.
prefix_lines() {
  local line
  trap '' PIPE
  while IFS= read -r line || [[ -n $line ]]; do
    printf '%s: %s\n' "$1" "$line" 2>/dev/null || true
  done
}

# Opens host number $1's stdin: a pipe, made of its FIFO because bash has
# no pipe(2). This script writes to write_fds[$1], the host reads from
# read_fds[$1]. Read-write first: either end alone would wait for the other.
open_pipe() {
  local fifo=$tmp/stdin.$1 both write read
  exec {both}<>"$fifo"
  exec {write}>"$fifo"
  exec {read}<"$fifo" {both}>&-
  write_fds[$1]=$write
  read_fds[$1]=$read
}

# Run by each host's pipeline as it starts: its stdin is its pipe's read
# end, and it holds no write end, which would keep its stdin from closing.
take_stdin() {
  local fd
  exec <&"${read_fds[$1]}"
  for fd in "${write_fds[@]}" "${read_fds[@]}"; do exec {fd}>&-; done
}

# Runs host number $1's part of the job, in a subshell of its own, with its
# output in its log and here, each line prefixed with the host.
run_host() {
  local i=$1 rendezvous relay status
  # Its programs ignore Ctrl-C and Ctrl-\, which a terminal sends to the
  # whole group, the SIGHUP of a terminal closed, and a SIGTERM to the whole
  # group (timeout(1)) or to every process (systemd): this script stops the
  # host, by closing its stdin. Killed by them, the pipe would lose the host's
  # last output. (Bash ignores INT and QUIT in a background subshell, but not
  # in the programs that subshell runs.)
  trap '' HUP INT QUIT TERM
  take_stdin "$i"
  set_node_args "$i"
  if ((i == 0)); then rendezvous=-; fi
  build_command "$i" run_node "$job_id/$i" "$workdir" "${addresses[i]}" "$SILENCE_SECONDS" \
    "$rendezvous" "$torchrun" "${node_args[@]}"
  # The host's status is its command's, not tee's: a full disk under the logs
  # must not fail a job that ran (tee says so, and goes on).
  set +o pipefail
  # The host reads the job's variables, then its pipe, from a relay through
  # a FIFO of its own. Written by this script, variables larger than the
  # pipe holds would block it before the host had started. Once the pipe
  # closes, the relay ends, and the host's stdin closes. (<&0: a background
  # job's stdin is otherwise /dev/null.)
  { printf '%s\0' "${env_entries[@]}" '' && exec cat; } <&0 >"$tmp/relay.$i" &
  relay=$!
  # A local host's command gets SIGTERM back, as its job stops its workers by
  # it; ssh keeps ignoring it (out of reach of a SIGTERM to the group, in a
  # session of its own, it gets one only as every process does).
  (if [[ -n ${local_node[i]} ]]; then trap - TERM; fi && exec "${cmd[@]}") <"$tmp/relay.$i" 2>&1 \
    | tee -a "$log_dir/${labels[i]}.log" | prefix_lines "${labels[i]}"
  status=${PIPESTATUS[0]}
  # The host is done, and its pipe may stay open until this script notices.
  kill -s KILL "$relay" 2>/dev/null || true
  wait "$relay" 2>/dev/null || true # (no "Terminated" notice)
  return "$status"
}

# Starts every host, each with its stdin held open by this script only:
# closing it (or dying) stops that host.
start_hosts() {
  local i fd fifos=()
  for i in "${!labels[@]}"; do fifos+=("$tmp/stdin.$i" "$tmp/relay.$i"); done
  mkfifo "${fifos[@]}"
  # Until every host has started, this script runs no other program (one
  # killed by a signal to the whole group would end it, through set -e),
  # and a signal is only noted: the hosts stop once all have started.
  trap 'signal_status=${signal_status:-129}' HUP
  trap 'signal_status=${signal_status:-130}' INT
  trap 'signal_status=${signal_status:-143}' TERM
  for i in "${!labels[@]}"; do
    open_pipe "$i"
    run_host "$i" & # wait_for_hosts gets the status of its whole pipeline by this pid
    running[$!]=$i
    started[i]=$SECONDS
    fd=${read_fds[i]}
    exec {fd}<&-
    unset "read_fds[i]"
  done
  trap 'on_signal 129' HUP
  trap 'on_signal 130' INT
  trap 'on_signal 143' TERM
  trap '' PIPE # a host that is already gone must not kill this script
  if [[ -n $signal_status ]]; then stop_on_signal; fi
}

# Closes host number $1's stdin, which stops it, if this script still holds it.
close_stdin() {
  local fd=${write_fds[$1]:-}
  if [[ -n $fd ]]; then exec {fd}>&-; fi
  unset "write_fds[$1]"
}

stop_hosts() {
  local i
  for i in "${!write_fds[@]}"; do close_stdin "$i"; done
  stopping=yes
}

send_heartbeat() {
  local fd
  for fd in "${write_fds[@]}"; do printf '\0' 2>/dev/null 1>&"$fd" || true; done
}

# The first signal stops the hosts; a second leaves them (see leave_hosts).
on_signal() {
  if [[ -n $signal_status ]]; then
    leaving="at a second signal"
  else
    signal_status=$1
    stop_on_signal
  fi
}

stop_on_signal() {
  echo "launch.sh: stopping the job on every host (signal again to stop waiting)" >&2 || true
  stop_hosts
}

# Kills the children of process $1: by pkill -P where there is one (macOS,
# and Linux with procps), else by the parent pids in /proc (slim Linux
# images). Bash knows no pid of a pipeline's programs.
kill_children() {
  local path stat parent
  if command -v pkill >/dev/null; then
    pkill -KILL -P "$1" || true
    return
  fi
  for path in /proc/[0-9]*/stat; do
    { read -r stat <"$path"; } 2>/dev/null || continue # gone meanwhile
    read -r _ parent _ <<<"${stat##*) }"                # after the name, which may hold ") "
    if ((parent == $1)); then kill -s KILL "${path//[^0-9]/}" 2>/dev/null || true; fi
  done
}

# Stops waiting for the hosts still running: kills each one's run_host and
# what it runs here (ssh, or a local host's shell, tee, prefix_lines and the
# relay of its stdin), which would otherwise write here after this script is
# gone. Stopped first, a run_host starts nothing more, and reports no program
# killed. Part of the job may live on there.
leave_hosts() {
  local pid i
  for pid in "${!running[@]}"; do
    i=${running[$pid]}
    kill -s STOP "$pid" 2>/dev/null || true
    kill_children "$pid"
    kill -s KILL "$pid" 2>/dev/null || true
    statuses[i]=-
    durations[i]=$((SECONDS - started[i]))
    left[i]=yes
  done
  wait "${!running[@]}" 2>/dev/null || true # (no "Killed" notice)
  running=()
}

# Waits for every host; on the first failure, stops the others. Polls rather
# than `wait -n -p`, which needs bash 5.1 (RHEL 8 has 4.4): `wait PID` still
# gives the status of a process that is gone.
wait_for_hosts() {
  local pid i status polls=0 heartbeat_polls=0 heartbeat_seconds=$SECONDS stop_polls=0
  while ((${#running[@]})); do
    poll_pause
    polls=$((polls + 1))
    if [[ -n $stopping ]]; then stop_polls=$((stop_polls + 1)); fi
    # Due by either count: the polls hold when the wall clock steps back,
    # SECONDS when this script was stopped (Ctrl-Z) and polled nothing.
    if ((polls - heartbeat_polls >= HEARTBEAT_SECONDS * POLLS_PER_SECOND
      || SECONDS - heartbeat_seconds >= HEARTBEAT_SECONDS)); then
      send_heartbeat
      heartbeat_polls=$polls heartbeat_seconds=$SECONDS
    fi
    for pid in "${!running[@]}"; do
      if kill -0 "$pid" 2>/dev/null; then continue; fi
      status=0
      wait "$pid" || status=$?
      i=${running[$pid]}
      unset "running[$pid]"
      close_stdin "$i"
      statuses[i]=$status
      durations[i]=$((SECONDS - started[i])) # or, if the clock stepped back, the polls':
      ((durations[i] >= polls / POLLS_PER_SECOND)) || durations[i]=$((polls / POLLS_PER_SECOND))
      if [[ -n $stopping ]] && ((status == 143)); then stopped[i]=yes; fi # (else it ended by itself)
      if ((status != 0)) && [[ -z $stopping && -z $first_failure ]]; then
        first_failure=$i
        stop_hosts
      fi
    done
    if ((stop_polls > STOP_SECONDS * POLLS_PER_SECOND)); then leaving="after $STOP_SECONDS s of stopping"; fi
    if [[ -n $leaving && ${#running[@]} -gt 0 ]]; then leave_hosts; fi
  done
}

# Whether host number $1 failed for want of the rendezvous store, which lives
# in the first host's torchrun: once that host's job fails, the others'
# torchruns fail at once (RendezvousConnectionError), and may end before it.
lost_the_store() {
  local status=${statuses[0]}
  (($1 != 0)) && [[ $status =~ ^[0-9]+$ ]] && ((status != 0 && status != 143)) \
    && [[ $(tail -n 5 "$log_dir/${labels[$1]}.log") == *'RendezvousConnectionError: '* ]]
}

# Prints the last 20 lines of log $1 before torchrun's closing report: a
# traceback of its own that ends in ChildFailedError, and a table, 40 lines
# or more that would push out the workers' error above them. Above them, the
# lines launch.sh's code on the host wrote earlier (a rendezvous that refused).
print_log_end() {
  local end
  end=$(awk '/^Traceback \(most recent call last\):$/ { start = NR }
    /ChildFailedError/ && start { end = start - 1 } END { print (end > 0 ? end : NR) }' "$1")
  awk -v end="$end" 'NR > end { exit } NR > end - 20 || /^launch\.sh: /' "$1"
}

print_summary() {
  local i why names=()
  {
    echo "launch.sh: job $job_id, logs in $log_dir/"
    printf '  %-*s  %-4s  %s\n' "$label_width" HOST EXIT SECONDS
    for i in "${!labels[@]}"; do
      printf '  %-*s  %-4s  %s%s%s\n' "$label_width" "${labels[i]}" "${statuses[i]}" \
        "${durations[i]}" "${stopped[i]:+  (stopped by launch.sh)}" "${left[i]:+  (left stopping)}"
    done
    if [[ -n $first_failure ]]; then
      i=$first_failure
      why="exit ${statuses[i]}"
      case ${statuses[i]} in
        255) [[ -n ${local_node[i]} ]] || why+=": ssh lost the connection to it, or could not make one" ;;
        143) why+=": a SIGTERM there, or $SILENCE_SECONDS s without a word from launch.sh (was it stopped?)" ;;
      esac
      if lost_the_store "$i"; then
        echo "launch.sh: ${labels[i]} failed first ($why): its torchrun lost the rendezvous store," \
          "which ${labels[0]}'s serves; ${labels[0]} ended by itself (exit ${statuses[0]}), and the" \
          "end of its log may say why:"
        i=0
      else
        echo "launch.sh: ${labels[i]} failed first ($why); the end of its log:"
      fi
      print_log_end "$log_dir/${labels[i]}.log" | prefix_lines "  ${labels[i]}"
    fi
    if ((${#left[@]})); then
      for i in "${!left[@]}"; do names+=("${labels[i]}"); done
      echo "launch.sh: left ${names[*]} still stopping, $leaving; part of the job may run on" \
        "there: 'grep -lzF LAUNCH_JOB=$job_id/ /proc/*/environ' lists its processes"
    fi
  } >&2
}

main() {
  require_bash 4 4 # empty arrays under set -u
  local max_restarts=0 torchrun='' workdir=$PWD env_file='' port='' log_dir=logs
  local dry_run='' hostfile nproc script script_args=() size job_id cmd=() node_args=() i
  local labels=() destinations=() ports=() local_node=() addresses=() env_entries=()
  local ssh_command=() write_fds=() read_fds=() started=() statuses=() durations=() stopped=()
  local left=() stopping='' leaving='' first_failure='' signal_status='' label_width
  local -A running=()

  while (($#)); do
    case $1 in
      -h | --help) usage; exit 0 ;;
      --max-restarts) max_restarts=${2-} ;;
      --torchrun) torchrun=${2-} ;;
      --workdir) workdir=${2-} ;;
      --env-file) env_file=${2-} ;;
      --port) port=${2-} ;;
      --log-dir) log_dir=${2-} ;;
      --dry-run) dry_run=yes; shift; continue ;;
      -h=* | --help=* | --dry-run=*) die "${1%%=*} takes no value" ;;
      --*=*) set -- "${1%%=*}" "$(expand_tilde "${1#*=}")" "${@:2}"; continue ;;
      -*) die "unknown option: $1 (see --help)" ;;
      *) break ;;
    esac
    [[ -n ${2-} ]] || die "$1 needs a value"
    shift 2
  done
  (($# >= 2)) || die "usage: launch.sh [options] HOSTFILE NPROC_PER_NODE [SCRIPT [ARGS...]] (see --help)"
  hostfile=$1 nproc=$2 script=${3:-train.py}
  script_args=("${@:4}")

  [[ $nproc =~ ^([1-9][0-9]*|auto|gpu|cpu)$ ]] \
    || die "NPROC_PER_NODE must be a positive integer, or torchrun's auto, gpu or cpu: $nproc"
  case $script in
    -h | --help | --dry-run | --max-restarts* | --torchrun* | --workdir* | --env-file* | \
      --port* | --log-dir*) die "$script is an option of launch.sh: put it before HOSTFILE" ;;
    -m | --module) die "SCRIPT is a file, not -m MODULE: give a script that runs the module" ;;
    -*) die "SCRIPT comes before its arguments: launch.sh $hostfile $nproc train.py $script ..." ;;
  esac
  [[ $max_restarts =~ ^[0-9]+$ ]] || die "--max-restarts must be a number: $max_restarts"
  [[ -z $port ]] || is_port "$port" || die "--port must be a port number: $port"
  [[ $workdir == /* ]] || workdir=$PWD/$workdir # from here, as the default is
  size=$(($(quote_words "${script_args[@]}" | wc -c)))
  ((size <= MAX_ARGS_BYTES)) \
    || die "the arguments for $script take $size bytes quoted; at most $MAX_ARGS_BYTES fit: put them in a file"
  read_hostfile "$hostfile"
  collect_env
  if [[ -z $torchrun ]]; then
    torchrun=$(command -v torchrun) || die "torchrun not found on PATH; use --torchrun"
    # A pyenv shim picks its Python by settings of this shell and directory,
    # which the hosts do not share: send them the torchrun it stands for here.
    if [[ $torchrun == */shims/torchrun ]] && command -v pyenv >/dev/null; then
      torchrun=$(pyenv which torchrun) || die "pyenv finds no torchrun here; use --torchrun"
    fi
  fi
  read_ssh_command
  label_width=4
  for i in "${labels[@]}"; do ((${#i} <= label_width)) || label_width=${#i}; done

  # Every process of the job carries it, and a stop kills what carries it: two
  # launches in the same second from containers, where pids repeat, must not
  # share one. (Bash seeds RANDOM with the time in microseconds and the pid.)
  printf -v job_id '%(%Y%m%d-%H%M%S)T-%s-%04x' -1 "$$" "$RANDOM"
  tmp=$(mktemp -d) # global: the EXIT trap runs after main returns
  # Only in this shell: a subshell that a signal kills before it drops the
  # trap would run it too, and remove $tmp under this one.
  trap 'if ((BASHPID == $$)); then rm -rf "$tmp"; fi' EXIT
  mkfifo "$tmp/idle"
  exec {idle_fd}<>"$tmp/idle" # for poll_pause
  preflight
  if [[ -n $dry_run ]]; then
    print_dry_run
    exit 0
  fi

  log_dir=$log_dir/$job_id
  mkdir -p "$log_dir"
  start_hosts
  wait_for_hosts
  print_summary || true # a full disk under stderr loses the summary, not the exit status
  if [[ -n $signal_status ]]; then exit "$signal_status"; fi
  if [[ -n $first_failure ]]; then exit 1; fi
}

main "$@"
