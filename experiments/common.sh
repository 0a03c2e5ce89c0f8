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
