"""CItruS against a slow reference of the paper's Eqs. 1-5 (the authors' loop); its outer loop."""

import jax.numpy as jnp
import numpy as np
import pytest

from jax_longctx.run import generation as gen
from jax_longctx.run.instructed import split_prompt
from jax_longctx.methods import AttnContext, MethodError, get
from jax_longctx.core.rope import apply_rope, inv_freq
from jax_longctx.run.driver import generate
from tests.conftest import tiny_config

CFG = tiny_config(num_heads=6, num_kv_heads=2, head_dim=8)
B, H, KV, D = 2, 6, 2, 8
G = H // KV
VARIANTS = ("citrus_standard", "citrus_shared", "citrus_individual", "h2o_shared")
K, CHUNK, N_INS = 10, 4, 3
DOC_LENS = (14, 23)
_PADDED = -(-max(DOC_LENS) // CHUNK) * CHUNK


def _rand(rng, n):
  return (rng.normal(size=(B, n, H, D)).astype(np.float32) * 2,
          rng.normal(size=(B, n, KV, D)).astype(np.float32) * 2,
          rng.normal(size=(B, n, KV, D)).astype(np.float32))


def _ctx(start, stop, lengths):
  pos = np.broadcast_to(np.arange(start, stop), (B, stop - start))
  valid = pos < np.asarray(lengths)[:, None]
  return AttnContext(0, jnp.asarray(pos, jnp.int32), jnp.asarray(valid), inv_freq(CFG), CFG)


def _rope(x, pos):
  return np.asarray(apply_rope(jnp.asarray(x[None]), jnp.asarray(pos)[None], inv_freq(CFG)))[0]


def _ref_attend(cache, kpre, vall, qs, ks, vs):
  """The authors' step for one row: new tokens over [cache (shifted positions); themselves].

  Returns (out [S, H, d], scores of the cache slots summed over queries, mean over heads [n]).
  """
  n, s = len(cache), len(qs)
  qpos = np.arange(n, n + s)
  keys = np.concatenate([_rope(kpre[cache], np.arange(n)), _rope(ks, qpos)])
  vals = np.concatenate([vall[cache], vs])
  q = _rope(qs, qpos)
  mask = np.concatenate([np.ones((s, n), bool), np.tril(np.ones((s, s), bool))], axis=1)
  out, probs = np.zeros_like(q), np.zeros((s, n + s))
  for h in range(H):
    logits = np.where(mask, q[:, h] @ keys[:, h // G].T / np.sqrt(D), -np.inf)
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    out[:, h] = p @ vals[:, h // G]
    probs += p / H
  return out, probs[:, :n].sum(0)


def _top(cache, priority):
  keep = np.sort(np.argsort(-np.asarray(priority), kind="stable")[:K])
  return [cache[i] for i in keep]


def _per_query(history, p):
  total, queries = history.get(p, (0.0, 0))
  return total / max(queries, 1)


def _reference(name, doc, ins, length):
  """Kept positions after every chunk and at the end, and the chunk outputs, for one row."""
  q, k, v = doc
  qi, ki, vi = ins
  cache, twin, history, kept, outs = [], [], {}, [], []
  for s in range(0, length, CHUNK):
    e = min(s + CHUNK, length)
    new = list(range(s, e))
    out, chunk_sum = _ref_attend(cache, k, v, q[s:e], k[s:e], v[s:e])
    outs.append(out)
    mean = chunk_sum / (e - s)
    if name == "citrus_standard":
      cache = _top(cache, mean) + new
    elif name == "citrus_shared":
      cache = _top(cache, _ref_attend(cache, k, v, qi, ki, vi)[1] / N_INS) + new
    elif name == "h2o_shared":
      for p, sc in zip(cache, chunk_sum):  # (attention summed, queries that gave it)
        history[p] = (history.get(p, (0.0, 0))[0] + sc, history.get(p, (0.0, 0))[1] + e - s)
      ins = _ref_attend(cache, k, v, qi, ki, vi)[1] / N_INS
      cache = _top(cache, [_per_query(history, p) + x for p, x in zip(cache, ins)]) + new
    else:
      twin = _top(twin, _ref_attend(twin, k, v, qi, ki, vi)[1]) + new
      cache = _top(cache, mean) + new
    kept.append(list(twin if name == "citrus_individual" else cache))
  answer = twin if name == "citrus_individual" else cache
  final = _ref_attend(answer, k, v, qi, ki, vi)[1] / N_INS
  if name == "h2o_shared":
    final = final + np.asarray([_per_query(history, p) for p in answer])
  kept.append(_top(answer, final))
  return kept, np.concatenate(outs)


def _run(name, doc, ins):
  method = get(name, budget=K, chunk=CHUNK)
  state = method.init_state(CFG, B, 64, jnp.float32, CHUNK)
  kept, outs = [], []
  ins_ctx = _ctx(0, N_INS, (N_INS, N_INS))
  for s in range(0, _PADDED, CHUNK):
    if method.scores_with_instruction:
      _, state = method.score_instruction(state, *map(jnp.asarray, ins), ins_ctx)
    out, state = method.prefill(state, *(jnp.asarray(x[:, s:s + CHUNK]) for x in doc),
                                _ctx(s, s + CHUNK, DOC_LENS))
    outs.append(np.asarray(out))
    cache = method.answer_cache(state)
    assert cache.capacity == K + CHUNK and int(np.max(cache.n)) <= K + CHUNK
    kept.append(np.asarray(cache.pos))
  _, state = method.score_instruction(state, *map(jnp.asarray, ins), ins_ctx)
  state = method.evict_by_instruction(state)
  kept.append(np.asarray(method.answer_cache(state).pos))
  return kept, np.concatenate(outs, axis=1)


@pytest.mark.parametrize("name", VARIANTS)
def test_eviction_matches_the_papers_loop(name):
  rng = np.random.default_rng(7)
  doc, ins = _rand(rng, _PADDED), _rand(rng, N_INS)
  kept, outs = _run(name, doc, ins)
  for b, length in enumerate(DOC_LENS):
    ref_kept, ref_out = _reference(name, [x[b] for x in doc], [x[b] for x in ins], length)
    steps = -(-length // CHUNK)
    got = [[int(p) for p in step[b] if p >= 0] for step in kept[:steps] + kept[-1:]]
    assert got == ref_kept[:steps] + ref_kept[-1:]
    np.testing.assert_allclose(outs[b, :length], ref_out, atol=1e-5)
    assert all(len(set(step)) == len(step) for step in got)


def test_small_budget_changes_what_is_kept_per_variant():
  rng = np.random.default_rng(3)
  doc, ins = _rand(rng, _PADDED), _rand(rng, N_INS)
  finals = {name: [int(p) for p in _run(name, doc, ins)[0][-1][1] if p >= 0] for name in VARIANTS}
  assert all(len(f) == K for f in finals.values())
  assert finals["citrus_standard"] != finals["citrus_shared"]


def test_guided_methods_need_the_instruction(tiny):
  cfg, params = tiny
  with pytest.raises(gen.GenerationError, match="needs the instruction apart from the document"):
    generate(params, cfg, [[1, 2, 3]], get("citrus_shared"), max_new_tokens=2)
  with pytest.raises(gen.GenerationError, match="2 prompts but 1 instructions"):
    generate(params, cfg, [[1, 2], [3]], get("citrus_shared"), max_new_tokens=2,
                 instructions=[[4]])
  with pytest.raises(gen.GenerationError, match="empty instruction at batch index 0"):
    generate(params, cfg, [[1, 2]], get("citrus_shared"), max_new_tokens=2,
                 instructions=[[]])
  with pytest.raises(MethodError, match="chunk=0 must be >= 1"):
    get("citrus_standard", budget=8, chunk=0).init_state(cfg, 1, 64, jnp.float32, 8)


def test_split_prompt_takes_the_last_paragraph():
  assert split_prompt("doc one\n\ndoc two\n\nWhat is it?") == ("doc one\n\ndoc two\n\n",
                                                               "What is it?")
  assert split_prompt("a long document\nWhat is it?\n") == ("a long document\n", "What is it?\n")
  with pytest.raises(ValueError, match="cannot split a one-line prompt"):
    split_prompt("no break here")


@pytest.mark.parametrize("task", ["passkey", "niah_multikey", "chain_of_key"])
def test_tasks_say_where_their_instruction_starts(default_lm, task):
  from jax_longctx.app import tasks
  s = tasks.get(task).make(default_lm.tokenizer, 600, 0.5, seed=0, chat=True)
  assert s.document + s.instruction == s.prompt
  assert 0 < len(s.instruction) < 400 and "?" in s.instruction or "chain" in s.instruction


def test_api_and_eval_run_citrus_on_the_default_model(default_lm, tmp_path):
  from jax_longctx.app.eval import MethodSpec, run_sweep
  lm = default_lm
  doc = "The secret word is pumpkin. " + "The grass is green. The sky is blue. " * 40
  question = "\n\nWhat is the secret word?"
  # A budget that covers the document: exactly full attention over the same tokens.
  got = lm.generate(doc, "citrus_shared", budget=460, chunk=64, instruction=question,
                    chat=True, max_new_tokens=8)
  ids, ins = lm.apart(doc, question, chat=True)
  assert len(ids) < 460
  assert lm.tokenizer.decode(lm.generate([ids + ins], "full", max_new_tokens=8)[0]) == got[0]
  # The split and the two sweeps below run one setting (budget 128 < the document's tokens, so
  # it evicts; passkey's 12 new tokens) and one cache size (512: a ~470-token prompt, passkey at
  # 480 and ppl at 500 tokens), so they share one set of compiled 30-layer programs: each other
  # setting or size compiled its own (~25 s each on 2 cores).
  split = lm.generate(doc + question, "citrus_shared", budget=128, chunk=64, chat=True,
                      max_new_tokens=12)  # split after the last blank line
  assert split == lm.generate(doc + "\n\n", "citrus_shared", budget=128, chunk=64, chat=True,
                              max_new_tokens=12, instruction=question.lstrip())
  specs = MethodSpec.parse("citrus_shared", ["citrus_shared.budget=128", "citrus_shared.chunk=64"])
  recs = run_sweep(lm, "passkey", specs, [480], [0.5], 1, str(tmp_path / "pk"), chat=True)
  assert 0 <= recs[0]["score"] <= 1 and recs[0]["prediction"]
  recs = run_sweep(lm, "ppl", specs, [500], [0.5], 1, str(tmp_path / "ppl"),
                   task_options={"n_scored": 32})
  assert len(recs[0]["nll"]) == 32 and recs[0]["score"] > 1
