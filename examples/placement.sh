# Where one arm runs and how much of each GPU it may take; sourced by vllm_serve.sh and
# sglang_serve.sh, so both engines place their arms alike.
#
#   GPUS  the devices the experiment may use, a comma list (default 0)
#   TP    devices per arm
#   MEM   the memory share per arm, if you want to set it yourself
#
# With at least 2 x TP devices the flag-off arm gets the first TP of them and the flag-on
# arm the next TP, each with the engine's normal memory share. With fewer, both arms share
# the first TP devices and each may take at most 0.45 of their memory, so that both fit;
# timing is noisier then, because the arms compete for the same GPUs.
# Sets CUDA_VISIBLE_DEVICES (exported) and MEM_SHARE (empty: the engine's own default).
place_arm() {
    local arm=$1
    local -a devices
    IFS=, read -r -a devices <<< "${GPUS:-0}"
    if (( ${#devices[@]} < TP )); then
        echo "GPUS=${GPUS:-0} holds ${#devices[@]} device(s), fewer than TP=$TP" >&2
        exit 2
    fi
    local first=0
    MEM_SHARE=${MEM:-}
    if (( ${#devices[@]} >= 2 * TP )); then
        [[ $arm == on ]] && first=$TP
    else
        MEM_SHARE=${MEM:-0.45}
        echo "the arms share GPUs ${devices[*]:0:TP} (each at most $MEM_SHARE of their memory): timing on shared GPUs is noisier" >&2
    fi
    local IFS=,
    export CUDA_VISIBLE_DEVICES="${devices[*]:first:TP}"
}
