# shellcheck shell=bash
#
# What launch.sh runs on each host. launch.sh sends a function's source over
# SSH (declare -f), with torchrun_python's, and calls it there: check_node in
# preflight, run_node for the job. So these functions use no global and no
# other function of launch.sh.

# Prints the Python of torchrun $1 (as PATH finds it), which runs launch.sh's
# probes on the hosts, with no torch import: the python beside it (a venv's,
# conda's), else the one its #! line names (pip's: python3.11 -m pip install
# --user leaves no python beside it), even one that is not there (a venv's
# link to another machine's Python), else python3.
torchrun_python() {
  local path shebang=''
  path=$(command -v -- "$1") || return 1
  if [[ -x ${path%/*}/python ]]; then echo "${path%/*}/python"; return; fi
  IFS=' ' read -r shebang _ <"$path" 2>/dev/null || true
  shebang=${shebang#'#!'}
  if [[ $shebang == /*/python* ]]; then echo "$shebang"; else echo python3; fi
}

# Runs on each host: checks what run_node needs, the directory, torchrun and
# script, with the job's variables, read from stdin as run_node reads them
# (torchrun's Python may need an --env-file's LD_LIBRARY_PATH). On the first
# host, PORT is the rendezvous port to check, or "free" to pick one; elsewhere
# "-". GLOO and NCCL are the GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME the job
# gets, or "-" where it gets this host's own. NPROC is NPROC_PER_NODE.
# Prints "ok SSH_CONNECTION PORT TIME" ("-" where unknown), TIME as this
# host's clock has it, in seconds since the epoch.
check_node() {
  local workdir=$1 torchrun=$2 script=$3 port=$4 gloo=$5 nccl=$6 nproc=$7 python
  local interfaces=() names=() missing=() name prefix matched gloo_from nccl_from entry error bound
  local vendor gpu_seen=''
  while IFS= read -r -d '' entry && [[ -n $entry ]]; do export "${entry?}"; done
  echo # ends a line that the host's login scripts may have left open, a banner say
  if ((BASH_VERSINFO[0] * 100 + BASH_VERSINFO[1] < 403)); then
    echo "fail: bash $BASH_VERSION here; launch.sh needs 4.3 or newer on every host"
    return 1
  fi
  [[ -r /proc/self/environ ]] || { echo "fail: no /proc here to find the job's processes by"; return 1; }
  if ! cd -- "$workdir" 2>/dev/null; then
    # Its reason: a directory that is there may refuse this user, as one on a
    # Kerberized NFS does without a ticket.
    # shellcheck disable=SC2164 # a cd in a subshell, for its error message
    error=$(cd -- "$workdir" 2>&1)
    echo "fail: cannot enter $workdir here (${error##*: }): see --workdir"
    return 1
  fi
  if ! python=$(torchrun_python "$torchrun"); then
    if [[ $torchrun == /* ]]; then
      echo "fail: no torchrun at $torchrun"
    else
      echo "fail: no $torchrun on this host's PATH (as SSH sets it): give --torchrun an absolute path"
    fi
    return 1
  fi
  if ! error=$("$python" -I -S -c '' 2>&1); then
    if [[ $python == python3 ]] && ! command -v python3 >/dev/null; then
      echo "fail: no Python 3 for launch.sh's probes: none beside $torchrun or on its #! line, no python3 on PATH"
    elif [[ $python == /* && ! -e $python ]]; then
      echo "fail: no $python here, torchrun's Python (a venv made on another machine?)"
    elif [[ $error == *'error while loading shared libraries'* ]]; then
      echo "fail: $python does not start here (an LD_LIBRARY_PATH for --env-file?): ${error##*$'\n'}"
    else # the first line that names an error: Python's fatal ones end in lines of context
      echo "fail: $python does not start here: $(grep -m 1 -i error <<<"$error" || echo "${error##*$'\n'}")"
    fi
    return 1
  fi
  [[ -f $script ]] || { echo "fail: no $script in $workdir (cd to it, or see --workdir)"; return 1; }
  # torchrun's "gpu" is the number of GPUs torch sees, and a traceback where
  # there is none. A GPU shows as a device file (NVIDIA's, Jetson's, ROCm's,
  # WSL's), or before its first use, where no udev rule makes NVIDIA's, on the
  # PCI bus (vendor 0x10de, a display controller).
  if [[ $nproc == gpu ]] && ! compgen -G '/dev/nvidia[0-9]*' >/dev/null \
    && [[ ! -e /dev/nvhost-ctrl-gpu && ! -e /dev/kfd && ! -e /dev/dxg ]]; then
    for vendor in /sys/bus/pci/devices/*/vendor; do
      if [[ $(<"$vendor") == 0x10de && $(<"${vendor%vendor}class") == 0x03* ]]; then gpu_seen=yes; break; fi
    done 2>/dev/null
    if [[ -z $gpu_seen ]]; then
      echo "fail: NPROC_PER_NODE is gpu, but this host has no GPU (no /dev/nvidia0, none on its PCI bus):" \
        "give a number of processes per host instead, to train on the CPUs"
      return 1
    fi
  fi
  # Interface names differ from host to host (eth0, ens5): gloo fails at start-up
  # on one this host lacks, NCCL at its first collective. /proc/self/net/dev lists
  # the interfaces of this process's network namespace, two header lines first.
  gloo_from='from launch.sh' nccl_from='from launch.sh'
  if [[ $gloo == - ]]; then gloo=${GLOO_SOCKET_IFNAME-} gloo_from='set on this host'; fi
  if [[ $nccl == - ]]; then nccl=${NCCL_SOCKET_IFNAME-} nccl_from='set on this host'; fi
  {
    read -r _ && read -r _
    while IFS=: read -r name _; do interfaces+=("${name// /}"); done
  } </proc/self/net/dev
  IFS=, read -ra names <<<"$gloo"
  for name in "${names[@]}"; do
    [[ -z $name || " ${interfaces[*]} " == *" $name "* ]] || missing+=("$name")
  done
  if ((${#missing[@]})); then
    echo "fail: GLOO_SOCKET_IFNAME=$gloo ($gloo_from), but no interface ${missing[*]} here" \
      "(only ${interfaces[*]}): unset it, and launch.sh picks each host's own"
    return 1
  fi
  # NCCL's syntax: comma-separated prefixes, or exact names after "=", or names to
  # avoid after "^" (which this leaves alone); each may end in ":PORT".
  if [[ -n $nccl && $nccl != ^* ]]; then
    IFS=, read -ra names <<<"${nccl#=}"
    matched=''
    for name in "${interfaces[@]}"; do
      for prefix in "${names[@]}"; do
        prefix=${prefix%%:*}
        [[ -n $prefix ]] || continue
        if [[ $nccl == =* && $name == "$prefix" || $nccl != =* && $name == "$prefix"* ]]; then matched=yes; fi
      done
    done
    if [[ -z $matched ]]; then
      echo "fail: NCCL_SOCKET_IFNAME=$nccl ($nccl_from) matches no interface here (only ${interfaces[*]})"
      return 1
    fi
  fi
  # As torchrun will bind it: SO_REUSEADDR, so TIME_WAIT is no obstacle.
  if [[ $port != - ]] && ! bound=$("$python" -I -S -c 'import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
try:
    s.bind(("", 0 if sys.argv[1] == "free" else int(sys.argv[1])))
except OSError as e:
    sys.exit(e.strerror)
print(s.getsockname()[1])' "$port" 2>&1); then
    if [[ $port == free ]]; then
      echo "fail: cannot pick a free port: ${bound##*$'\n'}"
    else
      echo "fail: port $port (--port) cannot be bound here: ${bound##*$'\n'}"
    fi
    return 1
  fi
  if [[ $port != - ]]; then port=$bound; fi
  printf 'ok %s %s %(%s)T\n' "${SSH_CONNECTION:-- - - -}" "$port" -1
}

# Runs on each host: reads NUL-separated KEY=VALUE entries from stdin up to
# an empty one, runs the command with them and LAUNCH_JOB=JOB in its
# environment, and when it exits, or stdin closes or stays silent for
# SILENCE seconds, kills every process that carries the mark (torchrun starts
# its workers in sessions of their own). ADDRESS is where the other hosts
# reach this one; RENDEZVOUS is the first host's ADDRESS:PORT, or "-" on it.
run_node() {
  local job_mark=LAUNCH_JOB=$1 relay_mark=LAUNCH_RELAY=$1 workdir=$2 address=$3 silence=$4 rendezvous=$5
  local entries=() entry interface gloo_given name_address torchrun_pid
  local python reader silent status signal parent message=''
  shift 5
  while :; do
    IFS= read -r -d '' entry || return 143 # launch.sh is gone already
    [[ -n $entry ]] || break
    entries+=("$entry")
  done
  cd -- "$workdir" || return 1
  # gloo binds to the address this host's name resolves to, which Debian and
  # Ubuntu map to 127.0.1.1, where no other host can connect. Bind it to the
  # interface that holds ADDRESS instead, unless GLOO_SOCKET_IFNAME is set
  # here or sent. Where there is no ip (a container without iproute2, whose
  # /etc/hosts is the host's under --network=host), Python finds it: only by
  # each interface's first IPv4 address, but by any IPv6 one.
  local interface_of_address='import fcntl, socket, struct, sys
address = sys.argv[1]
names = []
if ":" in address:  # /proc/net/if_inet6: one address per line, in hex, its interface last
    packed = socket.inet_pton(socket.AF_INET6, address).hex()
    names = [line.split()[5] for line in open("/proc/net/if_inet6") if line.split()[0] == packed]
else:
    probe = socket.socket()
    for _, name in socket.if_nameindex():
        try:
            request = fcntl.ioctl(probe, 0x8915, struct.pack("256s", name.encode()))  # SIOCGIFADDR
        except OSError:  # no IPv4 address
            continue
        if socket.inet_ntoa(request[20:24]) == address:
            names.append(name)
print(*names[:1])'
  # The job's variables, for a program run in a subshell (the job's Python may
  # need an --env-file's LD_LIBRARY_PATH); this shell keeps its own.
  with_entries() (
    for entry in "${entries[@]}"; do export "${entry?}"; done
    "$@"
  )
  python=$(with_entries torchrun_python "$1")
  if command -v ip >/dev/null; then
    read -r _ interface _ < <(ip -o addr show to "$address" 2>/dev/null)
  else
    interface=$(with_entries "$python" -I -S -c "$interface_of_address" "$address" 2>/dev/null)
  fi
  # gloo binds the first address of the interface it is given: on lo, 127.0.0.1,
  # where another host reaches only itself. Routed fabrics put each host's
  # address on lo, as a /32; there gloo must go by the address of this host's
  # name instead, which their DNS gives.
  if [[ $interface == lo && $address != 127.* && $address != ::1 ]]; then interface=''; fi
  gloo_given=${GLOO_SOCKET_IFNAME+yes} # set here
  for entry in "${entries[@]}"; do
    if [[ $entry == GLOO_SOCKET_IFNAME=* ]]; then gloo_given=yes; fi # sent
  done
  if [[ -z $gloo_given && -n $interface ]]; then
    entries+=("GLOO_SOCKET_IFNAME=$interface")
  elif [[ -z $gloo_given ]]; then
    name_address=$(with_entries "$python" -I -S -c 'import socket
print(socket.getaddrinfo(socket.gethostname(), None)[0][4][0])' 2>/dev/null) || name_address=nothing
    if [[ $name_address != "$address" ]]; then
      echo "launch.sh: warning: gloo cannot bind $address here, so a gloo job (CPU training)" \
        "will not connect: no interface holds it first (GLOO_SOCKET_IFNAME binds an interface's" \
        "first address), and this host's name, $HOSTNAME, resolves to $name_address; map" \
        "$HOSTNAME to $address in /etc/hosts here"
    fi
  fi
  # On hosts but the first, the job starts as this program, which runs the
  # command once the first host accepts or refuses a connection to the
  # rendezvous port. Where a firewall drops the packets, torchrun would give
  # up only after 60 s, in a traceback. Refused, the first host's torchrun may
  # not be listening yet: the command starts at once, and a child of this
  # program goes on trying, and says so after 30 s of refusals (a firewall
  # that rejects them?) while torchrun tries on. Stopping it there would fail
  # a job whose first host is slow to import torch, from a cold network
  # filesystem, say; torchrun itself gives up after 100 s or more, in a
  # traceback, and launch.sh's summary shows this line above it. A listening
  # store takes a connection that closes at once. All of it runs in the job's
  # place, with its mark: a stop kills it like the job. (-I: no directory or
  # variable of the job's changes what it imports; -S: it needs no
  # site-packages, and starts in half the time without.)
  local reach_rendezvous_then_exec='import os, socket, sys, time
NO_ANSWER_SECONDS = 15  # of tries, each waiting up to 5 s for an answer
REFUSED_SECONDS = 30  # of refusals, before a word of warning
endpoint, command = sys.argv[1], sys.argv[2:]
host, port = endpoint.rsplit(":", 1)

def reach(seconds=5):
    """None once the rendezvous port takes a connection, else the error."""
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=seconds).close()
        return None
    except OSError as e:
        return e

def say_unreachable(error, seconds, why):
    print(f"launch.sh: this host cannot reach the rendezvous at {endpoint}, on the first host "
          f"({error.strerror or error}, for {seconds} s): {why}", file=sys.stderr, flush=True)

deadline = time.monotonic() + NO_ANSWER_SECONDS
error = reach()
while error is not None and not isinstance(error, ConnectionRefusedError):
    if time.monotonic() > deadline - 2:  # no time left for a pause and a try of a second
        say_unreachable(error, NO_ANSWER_SECONDS, "a firewall? The hosts must reach each other "
                        "on every TCP port, the ones gloo and NCCL pick too")
        sys.exit(1)
    time.sleep(1)
    error = reach(max(1, min(5, deadline - time.monotonic())))
command_pid = os.getpid()
if error is not None and os.fork() == 0:
    deadline = time.monotonic() + REFUSED_SECONDS
    while error is not None and os.getppid() == command_pid:  # until the command has ended
        if time.monotonic() > deadline:
            say_unreachable(error, REFUSED_SECONDS, "a firewall there that rejects it, or a "
                            "torchrun slow to start? torchrun goes on trying")
            break
        time.sleep(1)
        error = reach()
    os._exit(0)
os.execvp(command[0], command)'
  # Defined in here because only run_node's source (and torchrun_python's)
  # travels to the host.
  marked_pids() {
    grep -lsxzF "$1" /proc/[0-9]*/environ | cut -d/ -f3
  }
  signal_marked() {
    local pids
    mapfile -t pids < <(marked_pids "$1")
    if ((${#pids[@]})); then kill -s "$2" "${pids[@]}" 2>/dev/null || true; fi
  }
  # SIGKILL to torchrun, then SIGTERM to its workers, 5 s for them to end, and
  # SIGKILL. torchrun would answer a SIGTERM with a traceback, and spend
  # seconds closing the rendezvous: as the whole job is ending, nobody needs it.
  stop_job() {
    kill -s KILL "$torchrun_pid" 2>/dev/null || true
    signal_marked "$job_mark" TERM
    for _ in {1..25}; do
      [[ -n $(marked_pids "$job_mark") ]] || break
      sleep 0.2
    done
    signal_marked "$job_mark" KILL
  }
  # The relay ends once the last of the job's processes is gone; if one lives
  # on after 1 s (one that left the mark behind, or no signal ends: stuck in
  # the kernel on a hung mount or GPU), the relay is ended, so that ssh's
  # session, and launch.sh, need not wait for it.
  end_relay() {
    for _ in {1..5}; do
      [[ -n $(marked_pids "$relay_mark") ]] || return 0
      sleep 0.2
    done
    signal_marked "$relay_mark" KILL
  }
  # Exported in a subshell that becomes torchrun: the entries reach the job
  # only, so this shell keeps its PATH for the clean-up whatever an --env-file
  # line sets, and no command line holds their values (`env NAME=VALUE ...`
  # would show them in ps). 2>&1: ssh carries stderr on a channel of its own,
  # and the two would meet again cut mid-line. Both go through a relay, the
  # only holder of this host's output once this shell is done.
  (
    for entry in "${entries[@]}" "$job_mark"; do export "${entry?}" || exit 1; done
    if [[ $rendezvous != - ]]; then exec "$python" -I -S -c "$reach_rendezvous_then_exec" "$rendezvous" "$@"; fi
    exec "$@"
  ) </dev/null > >(export "${relay_mark?}" && exec cat) 2>&1 &
  torchrun_pid=$!
  # The reader ends when stdin closes or stays silent, and then this shell
  # stops the job; if this shell is gone (a kill -9), the reader does. It holds
  # no output, which would keep ssh's channel, and launch.sh, waiting. Silence
  # is counted in reads of 1 s: from bash 5.2, read -t checks its deadline on
  # the wall clock as each byte arrives, and a step forward past a longer one
  # would end the read as a heartbeat came in.
  {
    silent=0
    while ((silent < silence)); do
      if IFS= read -r -t 1 -d '' _; then
        silent=0
      elif (($? > 128)); then # timed out
        silent=$((silent + 1))
      else
        break # closed
      fi
    done
    read -r _ _ _ parent _ <"/proc/$BASHPID/stat"
    if ((parent != $$)); then stop_job; fi
  } <&0 >/dev/null 2>&1 & # (without <&0: /dev/null)
  reader=$!
  # Bash reports a job killed by a signal with four lines of the job's source,
  # on its stderr, when it sees fit: torchrun's end is told below in one line.
  exec 2>/dev/null
  # Polls rather than `wait -n`, which misses a job that ended before it was
  # called: the reader does, when launch.sh is stopped as the job starts.
  while kill -0 "$torchrun_pid" 2>/dev/null && kill -0 "$reader" 2>/dev/null; do
    sleep 0.2
  done
  status=0
  if kill -0 "$torchrun_pid" 2>/dev/null; then # stdin closed or silent
    status=143
    stop_job
  else
    wait "$torchrun_pid" || status=$?
    if ((status > 128)) && signal=$(kill -l "$status"); then # (or it exited so: bash cannot tell)
      message="launch.sh: torchrun was killed by SIG$signal (status $status)"
    fi
    signal_marked "$job_mark" KILL # what torchrun left behind
  fi
  kill "$reader" 2>/dev/null || true
  end_relay
  if [[ -n $message ]]; then echo "$message"; fi # after the job's last lines
  return "$status"
}
