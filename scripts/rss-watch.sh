# Sourced by the GPU machine's memory scripts: a process's peak RSS while it runs, and its report.
#
#   watch_rss PID METRICS STOP   VmHWM (KiB) of PID, sampled every 0.2 s until it ends, or until
#                                METRICS (a metrics.jsonl) matches STOP (then it is killed; empty:
#                                never)
#   report NAME LOG HWM_KIB      the peak in GiB and the plan's lines of LOG
watch_rss() {
    local pid=$1 metrics=$2 stop=$3 hwm=0 now
    while kill -0 "$pid" 2>/dev/null; do
        now=$(awk '/VmHWM/ { print $2 }' "/proc/$pid/status" 2>/dev/null)
        [[ -n $now ]] && hwm=$now
        if [[ -n $stop ]] && grep -q "$stop" "$metrics" 2>/dev/null; then
            kill -9 "$pid" 2>/dev/null
            break
        fi
        sleep 0.2
    done
    wait "$pid" 2>/dev/null
    echo "$hwm"
}
report() {
    echo "$1: peak RSS $(python3 -c "print(f'{$3 / 2**20:.2f}')") GiB"
    grep -E "Host|host memory|needs|plan" "$2" | head -8 | cut -c1-300
}
