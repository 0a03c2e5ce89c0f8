"""Task generators (determinism, length, depth) and scorers on hand-written predictions."""

import pytest

from jax_longctx.app import tasks
from jax_longctx.app.tasks import Sample, TaskError, base, parse_length

LENGTHS = (600, 2000)


@pytest.fixture(scope="module")
def tok(default_lm):
  return default_lm.tokenizer


@pytest.mark.parametrize("name", tasks.names())
@pytest.mark.parametrize("chat", [False, True])
def test_generators_are_deterministic_and_hit_the_length(tok, name, chat):
  task = tasks.get(name)
  for length in LENGTHS:
    a = task.make(tok, length, 0.5, seed=3, chat=chat)
    b = task.make(tok, length, 0.5, seed=3, chat=chat)
    assert a == b
    n = a.n_tokens if name == "ppl" else len(tok.encode(a.prompt))
    assert n == a.n_tokens and 0.99 * length <= n <= length
    if name != "ppl":
      assert a.prompt != task.make(tok, length, 0.5, seed=4, chat=chat).prompt


@pytest.mark.parametrize("name", ["passkey", "niah_single", "niah_single_text"])
@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 0.9])
def test_needle_sits_at_the_requested_depth(tok, name, depth):
  s = tasks.get(name).make(tok, 2000, depth, seed=1)
  value = s.expected[0]
  at = s.prompt.index(value)
  # Measured in tokens over the document part of the prompt (between the header and question).
  doc_start = s.prompt.index("." if name == "passkey" else "\n") + 1
  doc_end = s.prompt.rindex("What")
  before = len(tok.encode(s.prompt[doc_start:at]))
  total = len(tok.encode(s.prompt[doc_start:doc_end]))
  assert abs(before / total - depth) < 0.03


def _sample(task, expected):
  return Sample(task, "", tuple(expected), 100, 0.5, 0, 100)


def test_passkey_scorer():
  task, s = tasks.get("passkey"), _sample("passkey", ["68213"])
  assert task.score(" 68213. Remember it.", s) == 1.0
  assert task.score(" 68214", s) == 0.0
  assert task.score(" 6821", s) == 0.0  # partly right is wrong
  assert task.score(" the key is hidden", s) == 0.0


def test_niah_scorer_counts_each_value():
  task, s = tasks.get("niah_multivalue"), _sample("niah_multivalue", ["1234567", "7654321"])
  assert task.score("1234567 and 7654321", s) == 1.0
  assert task.score("only 1234567", s) == 0.5
  assert task.score("none here", s) == 0.0


def test_chain_of_key_scorer():
  task = tasks.get("chain_of_key", chain=4)
  s = _sample("chain_of_key", ["apple-boat", "boat-cloud", "cloud-dune", "dune-apple", "x-y"])
  assert task.score("apple-boat, boat-cloud, cloud-dune, dune-apple", s) == 1.0
  assert task.score("apple-boat, boat-cloud, x-y, dune-apple", s) == 0.5  # valid prefix of 2
  assert task.score("boat-cloud, cloud-zebra", s) == 0.25  # cloud-zebra is not a key
  assert task.score("nothing", s) == 0.0


def test_chain_of_key_keys_have_one_successor(tok):
  s = tasks.get("chain_of_key").make(tok, 1500, None, seed=2)
  firsts = [k.split("-")[0] for k in s.expected]
  assert len(firsts) == len(set(firsts)) and len(s.expected) > 50


@pytest.mark.parametrize("name", tasks.names() + tasks.expand("ruler"))
def test_no_prompt_runs_past_the_length_asked(tok, name):
  """Every task's prompt, chat template included, is at most the length asked: a "32K" prompt
  fits a 32,768-token window."""
  task = tasks.get(name)
  for length, chat in ((1800, True), (2900, False)):
    s = task.make(tok, length, 0.5, seed=1, chat=chat)
    n = len(s.expected) if name == "ppl" else len(tok.encode(s.prompt))
    assert n == s.n_tokens <= length, (name, length, chat)


def _every_count(monkeypatch):
  """fit_length as it searched before counts were settled from others: every n it visits
  encoded, nothing placed ahead."""
  monkeypatch.setattr(base._Counts, "reaches", lambda self, n, t: self.exact(n) >= t)
  monkeypatch.setattr(base._Counts, "bracket", lambda self, guess, thresholds: None)


class _Wiggly:
  """A tokenizer whose count of prompt n is ~n + 90, stepping back by up to 40 tokens at
  some n (as a needle moved to another boundary can, by less): monotone only within the margin."""

  def encode(self, text: str) -> list[int]:
    n = int(text)
    return [0] * (n + 90 - (n * 7919) % 41)


@pytest.mark.parametrize("tolerance", [0.005, 0.0])
@pytest.mark.parametrize("length", [95, 500, 3778, 9295, 12_345, 77_777, 2_097_152])
def test_fitting_finds_the_prompt_that_counting_every_step_finds(monkeypatch, length, tolerance):
  """Every answer settled from other counts is the exact count's, and so is the prompt found."""
  tok, build = _Wiggly(), str
  answers, reaches = [], base._Counts.reaches

  def checked(self, n, t):
    answers.append((reaches(self, n, t), len(tok.encode(build(n))) >= t))
    return answers[-1][0]
  monkeypatch.setattr(base._Counts, "reaches", checked)
  fast = base.fit_length(tok, length, build, length // 2, tolerance)
  assert all(got == exact for got, exact in answers), answers
  _every_count(monkeypatch)
  assert base.fit_length(tok, length, build, length // 2, tolerance) == fast


@pytest.mark.parametrize("name", ["passkey", "niah_multikey", "chain_of_key"])
def test_fitting_a_real_prompt_encodes_less_and_builds_the_same(tok, monkeypatch, name):
  builds = []
  real = base._Counts.exact

  def counted(self, n):
    if n not in self.texts:
      builds.append(n)
    return real(self, n)
  monkeypatch.setattr(base._Counts, "exact", counted)
  task = tasks.get(name)
  fast = task.make(tok, 12_000, 0.3, seed=5, chat=True)
  n_fast, builds[:] = len(builds), []
  _every_count(monkeypatch)
  assert task.make(tok, 12_000, 0.3, seed=5, chat=True) == fast
  assert n_fast < len(builds), (n_fast, len(builds))


def test_a_length_too_short_for_the_prompt_is_one_clear_line(tok):
  with pytest.raises(TaskError, match=r"^niah_multikey needs a length of at least \d+ tokens "
                     r"\(its prompt without filler\), got 20$"):
    tasks.get("niah_multikey").make(tok, 20, 0.5, seed=0)


def test_bad_task_input():
  with pytest.raises(TaskError, match="unknown task 'nope'"):
    tasks.get("nope")
  with pytest.raises(TaskError, match="^task 'passkey' has no option foo; its options: "
                     "max_new_tokens$"):
    tasks.get("passkey", foo=1)
  with pytest.raises(TaskError, match="^task 'niah_single' has no option variant; its options: "
                     "haystack, value_type, n_distractors, n_values, n_queries, max_new_tokens$"):
    tasks.get("niah_single", variant="multikey")
  with pytest.raises(TaskError, match="bad length"):
    parse_length("4q")
  assert parse_length("4k") == 4096 and parse_length("1500") == 1500


def test_heldout_ppl_texts_are_disjoint_from_evaluation_texts(tok):
  """Threshold calibration reads held-out prose (issue 39): no 32-token run of a held-out text
  occurs in an evaluation text of the same seeds."""
  def runs(task, seed):
    ids = task.make(tok, 600, None, seed).expected
    return {ids[i:i + 32] for i in range(0, len(ids) - 32)}
  evaluation, heldout = tasks.get("ppl"), tasks.get("ppl", heldout=True)
  seen = set().union(*(runs(evaluation, s) for s in range(8)))
  assert all(not (runs(heldout, s) & seen) for s in range(8))
  assert runs(evaluation, 3) & seen  # the check can see overlap: a text overlaps itself
  with pytest.raises(TaskError, match="not enough held-out prose"):
    heldout.make(tok, 200_000, None, 0)
