"""Which threads compiled a jitted function, from jax.monitoring's compile events."""

import contextlib
import threading

from jax import monitoring


@contextlib.contextmanager
def compiled_on(fun: str):
  """Yields a list that fills, while inside, with the name of the thread of each backend compile
  of the jitted function named `fun` (e.g. "decode_loop")."""
  threads = []

  def listen(event, _secs, fun_name="", **_):
    if event.endswith("backend_compile_duration") and fun_name == f"jit({fun})":
      threads.append(threading.current_thread().name)

  monitoring.register_event_duration_secs_listener(listen)
  try:
    yield threads
  finally:
    monitoring.unregister_event_duration_listener(listen)
