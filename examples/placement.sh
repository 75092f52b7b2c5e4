# Where one arm runs and how much of each GPU it may take: the one place that decides it.
# Sourced by vllm_serve.sh and sglang_serve.sh, so both engines place their arms alike, and
# asked by experiment.py, which must know whether the two arms share a device:
#
#   bash examples/placement.sh off|on     prints CUDA_VISIBLE_DEVICES=... and MEM_SHARE=...
#
#   GPUS  the devices the experiment may use, a comma list (default 0)
#   TP    devices per arm, a positive integer (default 1)
#   MEM   the memory share per arm, if you want to set it yourself (a number, e.g. 0.4)
#   WAIT  checked here too, so that a bad value stops the experiment before anything starts
#
# With at least 2 x TP devices the flag-off arm gets the first TP of them and the flag-on
# arm the next TP, each with the engine's normal memory share. With fewer, both arms share
# the first TP devices and each may take at most 0.45 of their memory, so that both fit;
# timing is noisier then, because the arms compete for the same GPUs, and the arms must
# start one after the other (experiment.py does): an engine's memory profiling counts the
# memory of another engine still loading on the same device as its own, and fails.
# Sets CUDA_VISIBLE_DEVICES (exported) and MEM_SHARE (empty: the engine's own default).
# Exit codes: 2 a variable is malformed, 3 GPUS holds fewer devices than TP.

check_placement_inputs() {
    local -a devices
    local device
    if [[ ! ${TP:-1} =~ ^[1-9][0-9]*$ ]]; then
        echo "TP=${TP:-} is not a positive integer" >&2
        exit 2
    fi
    if [[ -z ${GPUS:-0} || ${GPUS:-0} == *, || ${GPUS:-0} == ,* || ${GPUS:-0} == *,,* ]]; then
        echo "GPUS=${GPUS:-} has an empty entry (write it as 0 or 0,1)" >&2
        exit 2
    fi
    IFS=, read -r -a devices <<< "${GPUS:-0}"
    local -A seen=()
    for device in "${devices[@]}"; do
        if [[ ! $device =~ ^[0-9]+$ ]]; then
            echo "GPUS=$GPUS: '$device' is not a device number" >&2
            exit 2
        fi
        # as CUDA reads CUDA_VISIBLE_DEVICES: 00 and 0 are one device, which both arms would
        # then load onto, each with the engine's full memory share
        local first=${seen[$((10#$device))]:-}
        if [[ -n $first ]]; then
            local spelled=""
            [[ $first != "$device" ]] && spelled=" ('$first' and '$device' are one to CUDA)"
            echo "GPUS=$GPUS names device $((10#$device)) twice$spelled: give each device once" >&2
            exit 2
        fi
        seen[$((10#$device))]=$device
    done
    if [[ -n ${MEM:-} && ! $MEM =~ ^(0?\.[0-9]+|1(\.0*)?)$ ]]; then
        echo "MEM=$MEM is not a share of memory between 0 and 1" >&2
        exit 2
    fi
    if [[ -n ${WAIT:-} && ! $WAIT =~ ^[0-9]+(\.[0-9]+)?$ ]]; then
        echo "WAIT=$WAIT is not a number of seconds" >&2
        exit 2
    fi
}

place_arm() {
    local arm=$1
    local -a devices
    check_placement_inputs
    local tp=${TP:-1}
    IFS=, read -r -a devices <<< "${GPUS:-0}"
    if (( ${#devices[@]} < tp )); then
        echo "GPUS=${GPUS:-0} holds ${#devices[@]} device(s), fewer than TP=$tp" >&2
        exit 3
    fi
    local first=0
    MEM_SHARE=${MEM:-}
    if (( ${#devices[@]} >= 2 * tp )); then
        [[ $arm == on ]] && first=$tp
    else
        MEM_SHARE=${MEM:-0.45}
        echo "the arms share GPUs ${devices[*]:0:tp} (each at most $MEM_SHARE of their memory):" \
             "timing on shared GPUs is noisier" >&2
    fi
    local IFS=,
    export CUDA_VISIBLE_DEVICES="${devices[*]:first:tp}"
}

if [[ ${BASH_SOURCE[0]} == "$0" ]]; then  # run, not sourced: print the placement of one arm
    case "${1:-}" in
        off|on) ;;
        *) echo "usage: bash examples/placement.sh off|on" >&2; exit 2 ;;
    esac
    place_arm "$1"
    echo "CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES"
    echo "MEM_SHARE=$MEM_SHARE"
fi
