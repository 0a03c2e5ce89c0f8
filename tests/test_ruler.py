"""RULER's tasks: RULER's wording and sizing on the default model's tokenizer, expected answers
that the generated prompts bear out, RULER's metric on hand-made predictions, and bad input."""

import collections
import re

import pytest

from jax_longctx.app import tasks
from jax_longctx.app.tasks import TaskError
from jax_longctx.app.report import summary_table
from jax_longctx.app.tasks import ruler_suite
from jax_longctx.app.tasks.ruler import LEFT_OUT_NOTE, string_match_all

# Each RULER template's opening and answer prefix, typed from RULER's
# scripts/data/synthetic/constants.py (not read from the module under test).
RULER_WORDING = {
    "niah": ("Some special magic {type_needle_v} are hidden within the following text. Make sure "
             "to memorize it. I will quiz you about the {type_needle_v} afterwards.",
             " The special magic {type_needle_v} for {query} mentioned in the provided text are"),
    "variable_tracking": (
        "Memorize and track the chain(s) of variable assignment hidden in the following text.",
        " Answer: According to the chain(s) of variable assignment in the text above, {num_v} "
        "variables are assigned the value {query}, they are: "),
    "common_words_extraction": (
        "Below is a numbered list of words. In these words, some appear more often than others.",
        " Answer: The top 10 words that appear most often in the list are:"),
    "freq_words_extraction": (
        "Read the following coded text and track the frequency of each coded word.",
        " Answer: According to the coded text above, the three most frequently appeared words "
        "are:"),
}
GENERATE = {"niah": 128, "variable_tracking": 30, "common_words_extraction": 120,
            "freq_words_extraction": 50}


@pytest.fixture(scope="module")
def tok(default_lm):
  return default_lm.tokenizer


def _wording(task, sample) -> tuple[str, str]:
  """RULER's opening and answer prefix as this sample must show them."""
  opening, prefix = RULER_WORDING[task.kind]
  if task.kind == "niah":
    one = task.num_q * task.num_v == 1
    kind = task.type_v[:-1] if one else task.type_v
    query = sample.instruction.split(" for ")[1].split(" mentioned")[0]
    if one:  # RULER's singular rewording
      opening = opening.replace("Some", "A").replace("are", "is")
      prefix = prefix.replace("are", "is")
    return opening.format(type_needle_v=kind), prefix.format(type_needle_v=kind, query=query)
  if task.kind == "variable_tracking":
    value = re.search(r"assigned the value (\d+) in", sample.instruction).group(1)
    return opening, prefix.format(num_v=5, query=value)
  return opening, prefix


@pytest.mark.parametrize("name", ruler_suite.NAMES)
def test_prompts_hold_rulers_wording_and_fill_the_length_as_ruler_sizes_it(tok, name):
  task = tasks.get(f"ruler:{name}")
  assert task.tokens_to_generate == task.max_new_tokens == GENERATE[task.kind]
  for length, chat in ((2048, True), (4096, False)):
    s = task.make(tok, length, None, seed=3, chat=chat)
    assert s == task.make(tok, length, None, seed=3, chat=chat)
    assert s.prompt != task.make(tok, length, None, seed=4, chat=chat).prompt
    opening, prefix = _wording(task, s)
    assert opening in s.prompt and s.prompt.endswith(prefix), name
    template = task.template
    if task.kind == "niah":  # the rest of the template, each piece between its fields
      one = task.num_q * task.num_v == 1
      if one:
        template = template.replace("Some", "A").replace("are all", "is").replace("are", "is")
      template = template.replace("{type_needle_v}", task.type_v[:-1] if one else task.type_v)
    assert all(piece in s.prompt for piece in re.split(r"\{\w+\}", template)), name
    if chat:  # the answer prefix after the chat template, as RULER's prepare.py puts it
      assert s.prompt.rindex("<|im_start|>assistant\n") + len("<|im_start|>assistant\n") == (
          len(s.prompt) - len(prefix))
    # The largest haystack whose prompt leaves room for RULER's tokens to generate.
    n = task.units(tok, length, 3, chat)
    assert s.n_tokens == len(tok.encode(s.prompt))
    assert s.n_tokens + task.tokens_to_generate <= length
    more = task.build(tok, length, 3, n + 1, chat)[0]
    assert len(tok.encode(more)) + task.tokens_to_generate > length


def _after_last(prompt: str, marker: str, end: str) -> str:
  start = prompt.rindex(marker) + len(marker)
  return prompt[start:prompt.index(end, start)]


def test_aggregation_answers_are_the_most_frequent_words(tok):
  s = tasks.get("ruler:cwe").make(tok, 4096, None, seed=1)
  listed = _after_last(s.prompt, "Memorize the ones that appear most often.\n", "\nQuestion:")
  counts = collections.Counter(re.findall(r"\d+\. (.+?)(?= \d+\. |$)", listed)).most_common()
  assert {w for w, _ in counts[:10]} == set(s.expected) and len(s.expected) == 10
  assert counts[9][1] == 30 and counts[10][1] == 3  # RULER's 30 / 3 repeats at 4K and above

  s = tasks.get("ruler:fwe").make(tok, 2048, None, seed=1)
  coded = _after_last(s.prompt, "three most frequently appeared coded words. ", "\nQuestion:")
  counts = collections.Counter(w for w in coded.split() if w != "...").most_common()
  assert [w for w, _ in counts[:3]] == list(s.expected) and counts[2][1] > counts[3][1]


def test_vt_expects_every_variable_that_holds_the_value(tok):
  s = tasks.get("ruler:vt").make(tok, 2048, None, seed=2)
  value = re.search(r"assigned the value (\d+) in", s.instruction).group(1)
  real = s.prompt[s.prompt.rindex("Memorize and track"):]  # after the solved example
  holds = {value}
  for name, source in re.findall(r"VAR (\w+) = (?:VAR )?(\w+)", real):  # the chain, in order
    if source in holds:
      holds.add(name)
  assert holds - {value} == set(s.expected) and len(s.expected) == 5
  assert all(len(v) == 5 and v.isupper() for v in s.expected)


def test_niah_answers_are_the_values_of_the_asked_keys(tok):
  for name, asked, values in (("niah_multiquery", 4, 4), ("niah_multivalue", 1, 4),
                              ("niah_multikey_3", 1, 1)):
    s = tasks.get(f"ruler:{name}").make(tok, 2048, None, seed=5)
    question = s.instruction.split("\n")[0]
    keys = re.findall(r"[\w-]+-[\w-]+", question.split(" for ")[1].split(" mentioned")[0])
    assert len(keys) == asked and len(s.expected) == values
    found = [v for k in keys
             for v in re.findall(rf"for {re.escape(k)} is: ([\w-]+)\.", s.document)]
    assert sorted(found) == sorted(s.expected)


def test_string_match_all_is_rulers_formula():
  refs = [["1234567", "7654321"], ["Apple", "pear", "fig"], ["uuid-x"]]
  preds = ["1234567 and 7654321", "APPLE, and a fig", "nothing"]
  # Per prediction: 2/2, 2/3, 0/1; RULER's mean in % to 2 decimals: (1 + 0.6667 + 0) / 3.
  assert string_match_all(preds, refs) == 55.56
  assert string_match_all(["b"], [["a", "b"]]) == 50.0
  task = tasks.get("ruler:niah_multivalue")
  samples = [tasks.Sample(task.name, "", tuple(r), 100, None, 0, 90) for r in refs]
  scores = [task.score(p, s) for p, s in zip(preds, samples)]
  assert scores == pytest.approx([1.0, 2 / 3, 0.0])
  assert round(100 * sum(scores) / 3, 2) == string_match_all(preds, refs)


def test_bad_ruler_input(tok):
  with pytest.raises(TaskError, match="unknown RULER task 'niah_single_9'; RULER's tasks here: "
                     "niah_single_1, niah_single_2, .*, vt, cwe, fwe$"):
    tasks.expand("ruler:vt,niah_single_9")
  for name, data in (("qa_1", "SQuAD"), ("qa_2", "HotpotQA")):
    with pytest.raises(TaskError, match=rf"^RULER's {name} \({data}\) is not offered: RULER "
                       r"downloads its data .*; RULER's tasks here are niah_single_1, .*, fwe\.$"):
      tasks.expand(f"ruler:{name}")
  assert tasks.expand("ruler") == [f"ruler:{n}" for n in ruler_suite.NAMES]
  assert len(ruler_suite.NAMES) == 11
  need = tasks.get("ruler:vt").min_length(tok, 600)
  with pytest.raises(TaskError, match=f"ruler:vt needs a length of at least {need} tokens .* "
                     "30 tokens to generate\\), got 600"):
    tasks.get("ruler:vt").make(tok, 600, None, 0)
  with pytest.raises(TaskError, match="task 'ruler:cwe' has no option freq_cw; RULER's tasks "
                     "take only max_new_tokens"):
    tasks.get("ruler:cwe", freq_cw=5)


def test_ruler_table_averages_the_tasks_and_counts_each_cell():
  """RULER's average is the mean of the tasks' scores, not of the samples pooled."""
  recs = [dict(task=f"ruler:{t}", method="full", length=4096, depth=None, seed=i, score=s)
          for t, scores in (("cwe", [0.0]), ("vt", [1.0, 1.0])) for i, s in enumerate(scores)]
  table = summary_table(recs)
  assert LEFT_OUT_NOTE in table
  rows = table[table.index("| task | 4K |"):].splitlines()
  assert rows[2:5] == ["| vt | 100.0 (n=2) |", "| cwe | 0.0 (n=1) |",
                       "| **average** | **50.0** (2 tasks, n=3) |"]
