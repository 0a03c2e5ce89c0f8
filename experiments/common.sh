# Shared by the experiment scripts (sourced): length arithmetic in tokens.
# tokens 64k -> 65536; tokens 3000 -> 3000.
tokens() {
  local n=${1,,}
  case $n in
    *k) echo $(( ${n%k} * 1024 )) ;;
    *) echo "$n" ;;
  esac
}
# cache_len 8k,64k -> the longest length + 2048 slots (answer tokens and the chat template's
# margin), so one cache size, and one compile per method, serves the whole sweep.
cache_len() {
  local longest=0 t
  for t in ${1//,/ }; do
    t=$(tokens "$t")
    (( t > longest )) && longest=$t
  done
  echo $(( longest + 2048 ))
}
# on_processes N CMD...: CMD once (N = 1: one process over every visible device), or N
# processes, one per GPU (CUDA_VISIBLE_DEVICES=i, jax.distributed on localhost as a multi-host
# user runs it; the eval's process 0 writes), waiting for all.
on_processes() {
  local n=$1 port i pids=()
  shift
  if (( n == 1 )); then
    "$@"
    return
  fi
  port=$(python -c "import socket; s = socket.socket(); s.bind(('localhost', 0)); print(s.getsockname()[1])")
  for (( i = 0; i < n; i++ )); do
    CUDA_VISIBLE_DEVICES=$i "$@" --coordinator "localhost:$port" --num-processes "$n" \
      --process-id "$i" &
    pids+=($!)
  done
  for i in "${pids[@]}"; do wait "$i"; done
}
