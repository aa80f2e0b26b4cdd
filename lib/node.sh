# shellcheck shell=bash
#
# What launch.sh runs on each host, sent as source (declare -f): check_node in preflight,
# run_node for the job. So they use no global and no function of launch.sh.

# Checks the directory, torchrun and the script with the job's variables (from stdin), and on
# the first host the rendezvous PORT (0: a free one); prints "ok SSH_CONNECTION PORT" or "fail: WHY".
check_node() {
  local workdir=$1 torchrun=$2 script=$3 port=$4 entry path python error
  while IFS= read -r -d '' entry && [[ -n $entry ]]; do export "${entry?}"; done
  echo # ends a line that a login script left open (a banner, say)
  if ! error=$(cd -- "$workdir" 2>&1); then
    echo "fail: cannot enter $workdir here (${error##*: }): see --workdir"
    return 1
  fi
  cd -- "$workdir" || return 1
  path=$(command -v -- "$torchrun") || { echo "fail: no torchrun at $torchrun here: see --torchrun"; return 1; }
  [[ -f $script ]] || { echo "fail: no $script in $workdir: cd to it, or see --workdir"; return 1; }
  if [[ $port != - ]]; then
    python=${path%/*}/python # a venv's or conda's, else the one pip's #! line names, else python3
    [[ -x $python ]] || IFS=' ' read -r python _ <"$path" || true
    python=${python#'#!'}
    [[ $python == /*python* ]] || python=python3
    if ! port=$("$python" -I -S -c 'import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port in TIME_WAIT is free
s.bind(("", int(sys.argv[1])))
print(s.getsockname()[1])' "$port" 2>&1); then
      error="port $4 (--port) cannot be bound here"
      [[ $4 != 0 ]] || error="no free port found here with $python"
      echo "fail: $error: ${port##*] }"
      return 1
    fi
  fi
  echo "ok ${SSH_CONNECTION:-- - - -} $port"
}

# Prints the pids of the processes whose environment holds $1 (NAME=VALUE).
marked() {
  grep -lsxzF "$1" /proc/[0-9]*/environ | cut -d/ -f3
}

# Sends signal $2 to the processes marked $1.
signal_marked() {
  local pids
  mapfile -t pids < <(marked "$1")
  ((${#pids[@]} == 0)) || kill -s "$2" "${pids[@]}" 2>/dev/null
}

# Stops run_node's job: KILL torchrun (a SIGTERM would get a traceback from it, and
# seconds spent closing the rendezvous), TERM its workers, and KILL what is left in 5 s.
stop_job() {
  kill -s KILL "$torchrun_pid" 2>/dev/null
  signal_marked "$job_mark" TERM
  for _ in {1..25}; do
    [[ -n $(marked "$job_mark") ]] || break
    sleep 0.2
  done
  signal_marked "$job_mark" KILL
}

# Starts "$@" (torchrun) once the rendezvous answers or refuses (not a dropping firewall), with
# the job's variables in its environment only: in no command line (ps), nor the clean-up's.
start_job() {
  local error
  export "${job_mark?}"
  # shellcheck disable=SC2016 # expanded by that bash
  if [[ $rdzv_host != - ]] && ! error=$(timeout 10 bash -c ': <>"/dev/tcp/$0/$1"' "$rdzv_host" "$rdzv_port" 2>&1) \
    && [[ $error != *refused* ]]; then
    error=${error##*: }
    echo "launch.sh: this host cannot reach the rendezvous at $rdzv_host port $rdzv_port on the first host" \
      "(${error:-no answer in 10 s}): a firewall? The hosts must reach each other on every TCP port"
    exit 1
  fi
  for entry in "${entries[@]}"; do export "${entry?}"; done
  # gloo listens where the name resolves (Debian: 127.0.1.1): ADDRESS's interface, but not lo.
  if [[ -z ${GLOO_SOCKET_IFNAME+set} && -n $interface ]] \
    && [[ $interface != lo || $address == 127.* || $address == ::1 ]]; then
    export GLOO_SOCKET_IFNAME=$interface
  fi
  exec "$@"
}

# Runs the job, and kills every process marked LAUNCH_JOB=JOB when torchrun ends, or stdin (launch.sh's
# heartbeats) closes or is silent for SILENCE s. RDZV_HOST is - on the first host.
run_node() {
  local job_mark=LAUNCH_JOB=$1 relay_mark=LAUNCH_RELAY=$1 workdir=$2 address=$3 silence=$4
  local rdzv_host=$5 rdzv_port=$6 entries=() entry interface torchrun_pid reader silent parent
  local status=0 signal message=''
  shift 6
  while :; do
    IFS= read -r -d '' entry || return 143 # launch.sh is gone already
    [[ -n $entry ]] || break
    entries+=("$entry")
  done
  cd -- "$workdir" || return 1
  read -r _ interface _ < <(ip -o addr show to "$address" 2>/dev/null) || interface=''
  command -v ip >/dev/null || echo "launch.sh: no ip here to find gloo's interface: install iproute2"
  # A relay, which this host ends even where an orphan without the mark holds the output.
  start_job "$@" </dev/null > >(export "${relay_mark?}" && exec cat) 2>&1 &
  torchrun_pid=$!
  # Silence in reads of 1 s, which no clock step cuts short; with this shell gone, it stops the job.
  {
    silent=0
    while ((silent < silence)); do
      if IFS= read -r -t 1 -d '' _; then silent=0; elif (($? > 128)); then silent=$((silent + 1)); else break; fi
    done
    read -r _ _ _ parent _ <"/proc/$BASHPID/stat"
    if ((parent != $$)); then stop_job; fi
  } <&0 >/dev/null 2>&1 &
  reader=$!
  exec 2>/dev/null # bash's report of a killed job, in lines of source: one line below says it
  while kill -0 "$torchrun_pid" && kill -0 "$reader"; do sleep 0.2; done
  if kill -0 "$torchrun_pid"; then
    status=143
    stop_job
  else
    wait "$torchrun_pid" || status=$?
    if ((status > 128)) && signal=$(kill -l "$status"); then
      message="launch.sh: torchrun was killed by SIG$signal (status $status)"
    fi
    signal_marked "$job_mark" KILL # what torchrun left behind
  fi
  kill "$reader"
  for _ in {1..5}; do # the relay ends with the job's last process, or in 1 s
    [[ -n $(marked "$relay_mark") ]] || break
    sleep 0.2
  done
  signal_marked "$relay_mark" KILL
  [[ -z $message ]] || echo "$message"
  return "$status"
}
