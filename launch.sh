#!/usr/bin/env bash
#
# Usage: launch.sh [options] HOSTFILE NPROC_PER_NODE [SCRIPT [ARGS...]]
#
# Runs SCRIPT (default: train.py) with ARGS under torchrun on every host of HOSTFILE,
# over SSH, NPROC_PER_NODE processes each (a number, or torchrun's auto, gpu or cpu).
# HOSTFILE: one [user@]host[:port] a line, '#' comments; the first host serves the
# rendezvous; localhost and this machine's names run here, without SSH.
#
# Options, before HOSTFILE:
#   --max-restarts N  restart the workers on every host up to N times (default: 0)
#   --torchrun PATH   torchrun on every host (default: this machine's, at its path)
#   --workdir DIR     directory to run in on every host (default: this one)
#   --env-file FILE   KEY=VALUE lines to set on every host, taken as written
#   --port PORT       rendezvous port on the first host (default: a free one)
#   --log-dir DIR     each host's log in DIR/JOB_ID/HOST.log (default: logs)
#   --dry-run         check every host, print its command, start nothing
#   -h, --help        show this help
# SSH_COMMAND (default: ssh) runs every ssh call. LAUNCH_SILENCE_SECONDS (default: 30): a
# host stops its part after this long without a word from launch.sh, which waits as long for a check or a stop.
#
# Examples:
#   ./launch.sh hosts.txt 4
#   ./launch.sh hosts.txt 1 train.py --epochs 5 --checkpoint-dir checkpoints
#   SSH_COMMAND='ssh -F cluster.conf' ./launch.sh --env-file nccl.env hosts.txt gpu
# Exit status: 0 done, 1 a host failed, 2 bad usage, 130/143/129 Ctrl-C/SIGTERM/SIGHUP.
# How it works: docs/multi-node.md.

if [ -z "${BASH_VERSION:-}" ] || shopt -oq posix; then
  echo "launch.sh: run it with bash, not sh" >&2
  exit 2
fi
set -euo pipefail

THIS_FILE=$(readlink -f -- "${BASH_SOURCE[0]}") # lib/ is beside the real file, not a symlink
# shellcheck source=lib/hosts.sh
source "${THIS_FILE%/*}/lib/hosts.sh"
# shellcheck source=lib/node.sh
source "${THIS_FILE%/*}/lib/node.sh"

readonly FORWARDED='^(NCCL_.*|GLOO_.*|TORCH_.*|OMP_NUM_THREADS|CUDA_VISIBLE_DEVICES|PYTHONPATH)$'
readonly POLLS_PER_SECOND=5 # time is counted in polls of read -t, which no clock step changes

die() {
  echo "launch.sh: $*" >&2
  exit 2
}

# Sets cmd to run function $2 with arguments "${@:3}" on host number $1.
build_command() {
  local i=$1 function=$2 source level=ERROR
  shift 2
  source="$(declare -f check_node marked signal_marked stop_job start_job run_node); $function \"\$@\""
  # INFO for the check: ssh says why a login failed (Slurm's refusal is a banner).
  [[ $function != check_node ]] || level=INFO
  if [[ -n ${local_node[i]} ]]; then
    cmd=(bash -c "$source" launch.sh "$@")
  else
    cmd=("${ssh_command[@]}" -o BatchMode=yes -o LogLevel="$level" ${ports[i]:+-p "${ports[i]}"}
      "${destinations[i]}" "$(remote_bash_command "$source" "$@")")
  fi
  # A session of its own: a terminal's Ctrl-C reaches launch.sh alone, which stops the
  # host (an ssh through a ControlMaster would end and leave the job running).
  if command -v setsid >/dev/null; then cmd=(setsid "${cmd[@]}"); fi
}

# Fills env_entries with what every host gets in its environment.
collect_env() {
  local name line n=0
  env_entries=(TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1) # a fresh rendezvous store for each restart
  while IFS= read -r name; do
    [[ ! $name =~ $FORWARDED ]] || env_entries+=("$name=${!name}")
  done < <(compgen -e)
  [[ -n $env_file ]] || return 0
  require_file "$env_file"
  while IFS= read -r line || [[ -n $line ]]; do
    n=$((n + 1))
    ((n > 1)) || line=${line#$'\xef\xbb\xbf'} # from Windows: a byte-order mark, CRLF
    line=${line%$'\r'}
    [[ ! $line =~ ^[[:space:]]*(#|$) ]] || continue
    [[ $line =~ ^[A-Za-z_][A-Za-z0-9_]*= ]] \
      || die "$env_file:$n: not KEY=VALUE (no export, no spaces around =): ${line%%=*}" # (no value)
    if [[ ${line#*=} == *'$'* || ${line#*=} == [\"\']* ]]; then # as a shell's .env would have it
      echo "launch.sh: warning: $env_file:$n: ${line%%=*} gets its value as written, quotes and \$ included" >&2
    fi
    env_entries+=("$line")
  done <"$env_file"
}

# Runs check_node on every host at once, into $tmp/check.N, and cuts off (marks in
# timed_out) those still running after $silence s.
run_checks() {
  local i polls=0 pids=() node_port
  trap 'stop_checks 129' HUP
  trap 'stop_checks 130' INT
  trap 'stop_checks 143' TERM
  for i in "${!labels[@]}"; do
    node_port=-
    ((i != 0)) || node_port=${port:-0}
    build_command "$i" check_node "$workdir" "$torchrun" "$script" "$node_port"
    printf '%s\0' "${env_entries[@]}" '' | "${cmd[@]}" >"$tmp/check.$i" 2>&1 &
    pids[i]=$!
  done
  while ((polls < silence * POLLS_PER_SECOND)) && [[ -n $(jobs -rp) ]]; do
    read -r -t 0.2 -u "$idle_fd" _ || true # a poll: the program sleep would hold off the traps
    polls=$((polls + 1))
  done
  for i in "${!pids[@]}"; do
    if kill -s KILL "${pids[i]}" 2>/dev/null; then timed_out[i]=yes; fi
  done
  wait 2>/dev/null || true # (no notice of a check killed)
  trap - HUP INT TERM
}

stop_checks() {
  kill -s KILL "${pids[@]}" 2>/dev/null || true
  wait 2>/dev/null || true
  echo "launch.sh: stopped during preflight, nothing was started" >&2 || true
  exit "$1"
}

# Checks every host; sets addresses and port, or says what failed where and exits 1.
preflight() {
  local i out report fields client='' timed_out=() problems=()
  local -A seen=() # address -> host number
  run_checks
  for i in "${!labels[@]}"; do
    out=$(<"$tmp/check.$i")
    report=$(grep '^ok ' <<<"$out" | tail -n 1) || true
    if [[ -n ${timed_out[i]:-} && -n $report ]]; then
      problems[i]="its check passed, but its SSH session stayed open: a program that a login script"
      problems[i]+=" starts in the background holds its output (add >/dev/null 2>&1 there)"
    elif [[ -n ${timed_out[i]:-} ]]; then
      problems[i]="no answer within $silence s"
    elif [[ -z $report ]]; then
      problems[i]=$(ssh_failure "$out" "$(printf '%q %q' "${THIS_FILE%/*}/setup_ssh.sh" "$hostfile")")
      problems[i]=${problems[i]#fail: }
    else
      read -ra fields <<<"$report" # ok, SSH_CONNECTION's 4 fields, the port
      addresses[i]=${fields[3]}
      [[ ${fields[5]} == - ]] || port=${fields[5]}
      [[ -n ${local_node[i]} ]] || client=${client:-${fields[1]}} # this machine, as the hosts see it
    fi
  done
  for i in "${!addresses[@]}"; do
    [[ -z ${local_node[i]} ]] || addresses[i]=${client:-127.0.0.1}
    problems[i]=$(address_problem "$i" "$client")
    [[ -n ${problems[i]} ]] || unset 'problems[i]'
    seen[${addresses[i]}]=$i
  done
  ((${#problems[@]})) || return 0
  echo "launch.sh: preflight failed, nothing was started:" >&2
  for i in "${!problems[@]}"; do printf '  %-*s  %s\n' "$label_width" "${labels[i]}" "${problems[i]}" >&2; done
  exit 1
}

# Prints why host number $1's address cannot serve the job, if it cannot; $2 is this
# machine's address as the remote hosts see it.
address_problem() {
  local address=${addresses[$1]}
  if [[ -n ${local_node[$1]} && -n $2 ]] && command -v ip >/dev/null \
    && [[ -z $(ip -o addr show to "${2#::ffff:}") ]]; then
    echo "the other hosts see this machine as $2, which it does not hold (NAT or a jump host?):" \
      "launch from a host they reach directly"
  elif [[ $address == - ]]; then
    echo "its sshd sets no SSH_CONNECTION, so its address is unknown"
  elif [[ -n ${seen[$address]:-} ]]; then
    echo "reached at $address, as ${labels[${seen[$address]}]} is (one machine under two names?" \
      "containers behind one address?): every host needs its own address"
  elif [[ -z ${local_node[$1]} && ($address == 127.* || $address == ::1) && ${#labels[@]} -gt 1 ]]; then
    echo "reached at $address (a tunnel?): list it by an address the other hosts can reach"
  fi
}

# Sets node_args to torchrun's arguments for host number $1.
set_node_args() {
  local host=${addresses[0]} is_host=0
  [[ $host != *:* ]] || host="[$host]" # IPv6
  (($1 != 0)) || is_host=1
  node_args=(--nnodes="${#labels[@]}" --nproc-per-node="$nproc" --rdzv-backend=c10d
    --rdzv-endpoint="$host:$port" --rdzv-id="$job_id" --rdzv-conf="is_host=$is_host"
    --max-restarts="$max_restarts" --local-addr="${addresses[$1]}" "$script" "${script_args[@]}")
}

print_dry_run() {
  local i how names=("${env_entries[@]%%=*}")
  echo "environment on every host (a local one also has the rest of this shell's): ${names[*]}"
  for i in "${!labels[@]}"; do
    set_node_args "$i"
    how="ssh ${ports[i]:+-p ${ports[i]} }${destinations[i]}"
    [[ -z ${local_node[i]} ]] || how=local
    echo "${labels[i]} ($how): cd $(quote_words "$workdir") && $(quote_words "$torchrun" "${node_args[@]}")"
  done
}

# Prefixes each line with $1 whatever becomes of the output (a full disk, `| head`):
# the job must not die of it, and the log has every line.
prefix_lines() {
  local line
  trap '' PIPE
  while IFS= read -r line || [[ -n $line ]]; do printf '%s: %s\n' "$1" "$line" 2>/dev/null || true; done
}

# Runs host number $1's part of the job, its output in its log and here, prefixed. Its
# stdin is start_hosts' read end of a pipe (a FIFO: bash has no pipe(2)).
run_host() {
  local i=$1 fd relay status rdzv_host=${addresses[0]}
  # launch.sh stops the host by closing its pipe: no signal to the whole group may kill
  # the pipeline first and lose the host's last lines.
  trap '' HUP INT QUIT TERM
  exec <&"$read_fd" {read_fd}<&-
  for fd in "${write_fds[@]}"; do exec {fd}>&-; done # its stdin must close with launch.sh's end
  set_node_args "$i"
  ((i != 0)) || rdzv_host=-
  build_command "$i" run_node "$job_id/$i" "$workdir" "${addresses[i]}" "$silence" "$rdzv_host" "$port" \
    "$torchrun" "${node_args[@]}"
  set +o pipefail # the host's status is its command's, not tee's (a full disk under the logs)
  # The variables, then the heartbeats, through a relay: launch.sh must not block on
  # variables larger than a pipe holds. A local job stops its workers by SIGTERM.
  { printf '%s\0' "${env_entries[@]}" '' && exec cat; } <&0 >"$tmp/relay.$i" & # (else /dev/null)
  relay=$!
  (if [[ -n ${local_node[i]} ]]; then trap - TERM; fi && exec "${cmd[@]}") <"$tmp/relay.$i" 2>&1 \
    | tee -a "$log_dir/${labels[i]}.log" | prefix_lines "${labels[i]}"
  status=${PIPESTATUS[0]}
  kill -s KILL "$relay" 2>/dev/null || true
  wait "$relay" 2>/dev/null || true
  return "$status"
}

# Starts every host. Until all have, a signal is only noted, and no program runs here
# (one killed by a signal to the whole group would end launch.sh through set -e).
start_hosts() {
  local i fd fifos=() read_fd write_fd
  for i in "${!labels[@]}"; do fifos+=("$tmp/stdin.$i" "$tmp/relay.$i"); done
  mkfifo "${fifos[@]}"
  trap 'signal_status=${signal_status:-129}' HUP
  trap 'signal_status=${signal_status:-130}' INT
  trap 'signal_status=${signal_status:-143}' TERM
  for i in "${!labels[@]}"; do
    exec {fd}<>"$tmp/stdin.$i" # read-write first: either end alone would wait for the other
    exec {write_fd}>"$tmp/stdin.$i"
    exec {read_fd}<"$tmp/stdin.$i" {fd}>&-
    write_fds[i]=$write_fd
    run_host "$i" &
    running[$!]=$i started[i]=$SECONDS
    exec {read_fd}<&-
  done
  trap 'on_signal 129' HUP
  trap 'on_signal 130' INT
  trap 'on_signal 143' TERM
  trap '' PIPE # a host already gone must not kill launch.sh
  if [[ -n $signal_status ]]; then stop_hosts; fi
}

# Closes every host's pipe, which stops it.
stop_hosts() {
  local fd
  if [[ -n $signal_status ]]; then echo "launch.sh: stopping the job on every host (signal again to stop waiting)" >&2 || true; fi
  for fd in "${write_fds[@]}"; do exec {fd}>&-; done
  write_fds=() stopping=yes
}

# The first signal stops the hosts; a second leaves them.
on_signal() {
  if [[ -n $signal_status ]]; then leaving="at a second signal"; return; fi
  signal_status=$1
  stop_hosts
}

# Stops waiting for the hosts still running: kills each run_host (stopped first, so that
# it starts nothing more) and its programs here. Part of the job may live on there.
leave_hosts() {
  local pid i
  for pid in "${!running[@]}"; do
    kill -s STOP "$pid" 2>/dev/null || true
    pkill -KILL -P "$pid" || true # its pipeline's programs, whose pids bash does not know
    kill -s KILL "$pid" 2>/dev/null || true
    i=${running[$pid]}
    statuses[i]=- durations[i]=$((SECONDS - started[i])) left[i]=yes
  done
  wait "${!running[@]}" 2>/dev/null || true
  running=()
}

# Waits for every host, sending heartbeats; on the first failure, stops the others.
wait_for_hosts() {
  local pid i fd status polls=0 beat_polls=0 stop_polls=0 beat=$((silence / 6))
  while ((${#running[@]})); do
    read -r -t 0.2 -u "$idle_fd" _ || true
    polls=$((polls + 1))
    [[ -z $stopping ]] || stop_polls=$((stop_polls + 1))
    if ((polls - beat_polls >= beat * POLLS_PER_SECOND)); then
      for fd in "${write_fds[@]}"; do printf '\0' 2>/dev/null 1>&"$fd" || true; done
      beat_polls=$polls
    fi
    for pid in "${!running[@]}"; do
      if kill -0 "$pid" 2>/dev/null; then continue; fi
      status=0
      wait "$pid" || status=$?
      i=${running[$pid]}
      unset "running[$pid]"
      statuses[i]=$status durations[i]=$((SECONDS - started[i]))
      if [[ -n $stopping ]] && ((status == 143)); then stopped[i]=yes; fi
      if ((status != 0)) && [[ -z $stopping ]]; then
        first_failure=$i
        stop_hosts
      fi
    done
    if ((stop_polls > silence * POLLS_PER_SECOND)); then leaving="after $silence s of stopping"; fi
    if [[ -n $leaving ]]; then leave_hosts; fi
  done
}

# Prints the last 20 lines of log $1 before torchrun's own report (a traceback ending in
# ChildFailedError and a table, which push out the workers' error), and above them
# what launch.sh's code on the host said.
print_log_end() {
  local end
  end=$(awk '/^Traceback \(most recent call last\):$/ { start = NR }
    /ChildFailedError/ && start { end = start - 1 } END { print (end > 0 ? end : NR) }' "$1")
  awk -v end="$end" 'NR > end { exit } NR > end - 20 || /^launch\.sh: /' "$1"
}

print_summary() {
  local i why names=()
  echo "launch.sh: job $job_id, logs in $log_dir/"
  printf '  %-*s  %-4s  %s\n' "$label_width" HOST EXIT SECONDS
  for i in "${!labels[@]}"; do
    printf '  %-*s  %-4s  %s%s%s\n' "$label_width" "${labels[i]}" "${statuses[i]}" "${durations[i]}" \
      "${stopped[i]:+  (stopped by launch.sh)}" "${left[i]:+  (left stopping)}"
  done
  if [[ -n $first_failure ]]; then
    i=$first_failure why="exit ${statuses[i]}"
    case ${statuses[i]} in
      255) [[ -n ${local_node[i]} ]] || why+=": ssh lost the connection to it, or could not make one" ;;
      143) why+=": a SIGTERM there, or $silence s without a word from launch.sh (was it stopped?)" ;;
    esac
    # The others' torchruns fail at once when the first host's, which holds the store, ends.
    if ((i != 0)) && [[ ${statuses[0]} =~ ^[1-9][0-9]*$ && ${statuses[0]} != 143 ]] \
      && tail -n 5 "$log_dir/${labels[i]}.log" | grep -q 'RendezvousConnectionError: '; then
      echo "launch.sh: ${labels[i]} failed first ($why): its torchrun lost the rendezvous store, which" \
        "${labels[0]}'s serves; ${labels[0]} ended by itself (exit ${statuses[0]}), and the end of its log may say why:"
      i=0
    else
      echo "launch.sh: ${labels[i]} failed first ($why); the end of its log:"
    fi
    print_log_end "$log_dir/${labels[i]}.log" | prefix_lines "  ${labels[i]}"
  fi
  if ((${#left[@]})); then
    for i in "${!left[@]}"; do names+=("${labels[i]}"); done
    echo "launch.sh: left ${names[*]} still stopping, $leaving; part of the job may run on there:" \
      "'grep -lzF LAUNCH_JOB=$job_id/ /proc/*/environ' lists its processes"
  fi
}

# Sets main's variables from the command line.
parse_args() {
  local missing=NPROC_PER_NODE
  while (($#)); do
    case $1 in
      -h | --help) sed -n '3,/^$/s/^# \{0,1\}//p' "$THIS_FILE"; exit 0 ;;
      --dry-run) dry_run=yes; shift; continue ;;
      --max-restarts) max_restarts=${2-} ;;
      --torchrun) torchrun=${2-} ;;
      --workdir) workdir=${2-} ;;
      --env-file) env_file=${2-} ;;
      --port) port=${2-} ;;
      --log-dir) log_dir=${2-} ;;
      -h=* | --help=* | --dry-run=*) die "${1%%=*} takes no value" ;;
      --*=\~ | --*=\~/*) set -- "${1%%=*}" "$HOME${1#*=\~}" "${@:2}"; continue ;; # the shell left it
      --*=*) set -- "${1%%=*}" "${1#*=}" "${@:2}"; continue ;;
      -*) die "unknown option: $1 (see --help)" ;;
      *) break ;;
    esac
    [[ -n ${2-} ]] || die "$1 needs a value"
    shift 2
  done
  (($#)) || missing="HOSTFILE and NPROC_PER_NODE"
  (($# >= 2)) || die "missing $missing: launch.sh [options] HOSTFILE NPROC_PER_NODE [SCRIPT [ARGS...]]"
  hostfile=$1 nproc=$2 script=${3:-train.py} script_args=("${@:4}")
  [[ $nproc =~ ^([1-9][0-9]*|auto|gpu|cpu)$ ]] \
    || die "NPROC_PER_NODE must be a positive integer, or torchrun's auto, gpu or cpu: $nproc"
  case $script in
    -h | --help | --dry-run | --max-restarts* | --torchrun* | --workdir* | --env-file* | --port* | --log-dir*)
      die "$script is an option of launch.sh: put it before HOSTFILE" ;;
    -m | --module) die "SCRIPT is a file, not -m MODULE: give a script that runs the module" ;;
    -*) die "SCRIPT comes before its arguments: launch.sh $hostfile $nproc train.py $script ..." ;;
  esac
  [[ $max_restarts =~ ^[0-9]+$ ]] || die "--max-restarts must be a number: $max_restarts"
  [[ -z $port ]] || is_port "$port" || die "--port must be a port number: $port"
  [[ $silence =~ ^[1-9][0-9]*$ ]] || die "LAUNCH_SILENCE_SECONDS must be a whole number of seconds: $silence"
}

main() {
  ((BASH_VERSINFO[0] * 100 + BASH_VERSINFO[1] >= 404)) || die "needs bash 4.4 or newer (this is $BASH_VERSION)"
  local max_restarts=0 torchrun='' workdir=$PWD env_file='' port='' log_dir=logs dry_run=''
  local hostfile nproc script script_args=() job_id cmd=() node_args=() i label_width=4
  local labels=() destinations=() ports=() local_node=() addresses=() env_entries=() ssh_command=()
  local write_fds=() started=() statuses=() durations=() stopped=() left=() stopping='' leaving=''
  local first_failure='' signal_status='' silence=${LAUNCH_SILENCE_SECONDS:-30}
  local -A running=()
  parse_args "$@"
  [[ $workdir == /* ]] || workdir=$PWD/$workdir
  read_hostfile "$hostfile"
  collect_env
  [[ -n $torchrun ]] || torchrun=$(command -v torchrun) || die "no torchrun on PATH: activate its venv, or give --torchrun"
  read_ssh_command
  for i in "${labels[@]}"; do ((${#i} <= label_width)) || label_width=${#i}; done
  # Every process of the job carries it in its environment, and a stop kills what does:
  # two launches in one second from containers, where pids repeat, must not share one.
  printf -v job_id '%(%Y%m%d-%H%M%S)T-%s-%04x' -1 "$$" "$RANDOM"
  tmp=$(mktemp -d) # global: the EXIT trap runs after main returns
  trap 'if ((BASHPID == $$)); then rm -rf "$tmp"; fi' EXIT # not in a subshell killed early
  mkfifo "$tmp/idle"
  exec {idle_fd}<>"$tmp/idle"
  preflight
  if [[ -n $dry_run ]]; then print_dry_run; exit 0; fi
  log_dir=$log_dir/$job_id
  mkdir -p "$log_dir"
  start_hosts
  wait_for_hosts
  print_summary >&2 || true # a full disk under stderr loses the summary, not the exit status
  if [[ -n $signal_status ]]; then exit "$signal_status"; fi
  if [[ -n $first_failure ]]; then exit 1; fi
}

main "$@"
