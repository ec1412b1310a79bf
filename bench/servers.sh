# What the load scripts share (sourced): one server at a time on $PORT, started in the
# background with its pid in $pid; `up` waits for its /health, `stop` ends it (also on exit).
pid=
stop() { [ -n "$pid" ] && kill "$pid" 2>/dev/null && wait "$pid" 2>/dev/null; pid=; }
trap stop EXIT
up() {
  for _ in $(seq 1 240); do
    curl -sf "http://127.0.0.1:$PORT/health" >/dev/null 2>&1 && return 0
    sleep 0.5
  done
  echo "server did not come up" >&2; return 1
}
