"""experiments.route_compare on records in the repository: the tables it prints are the ones
docs/CLAIMS.md quotes, and a tree without counterparts says so."""

import os

from experiments import route_compare

RESULTS = os.path.join(os.path.dirname(__file__), "..", "docs", "results", "kv_quant",
                       "smollm2-135m")


def test_the_cpu_proxy_row():
  d = os.path.join(RESULTS, "reattention_products_8k_cpu")
  text = "\n".join(route_compare.compare(os.path.join(d, "dequantize"),
                                         os.path.join(d, "products")))
  assert "| . | reattention | 8192 | +0.020% | [-0.036, +0.075] | 4 | 505 of 512 |" in text


def test_the_gpu_rows_and_a_tree_without_counterparts(tmp_path):
  d = os.path.join(RESULTS, "reattention_products_h200")
  text = "\n".join(route_compare.compare(os.path.join(d, "dequantize"),
                                         os.path.join(d, "products")))
  assert "| int8-32k/ppl | reattention | 32768 | +0.005% | [-0.017, +0.027] | 100 |" in text
  assert "| int8-32k_64k/niah_multikey | niah_multikey | reattention | 65536 | 60 | 43 | 40 |" in text
  assert "| float8_e4m3fn-32k_64k/passkey | passkey | reattention | 32768 | 20 | 100 | 95 | 19 |" \
      in text
  out = route_compare.compare(os.path.join(d, "dequantize"), str(tmp_path))
  assert out == [f"no sweep of {os.path.join(d, 'dequantize')} has a counterpart with common "
                 f"samples in {tmp_path}"]
