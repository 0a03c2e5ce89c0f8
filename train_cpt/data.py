"""Training data: local text files tokenized, packed into rows of L + S tokens, split, batched.

Files are read in sorted order, tokenized, joined with the end-of-text token and cut into rows;
the last rows (a `heldout` fraction, at least one) are held out. The batch of step i is a pure
function of (seed, i): a run resumed from step i reads exactly the rows an uninterrupted run
would have read.
"""

from __future__ import annotations

import glob
import os

import numpy as np

from jax_longctx.core.errors import LongctxError


class DataError(LongctxError, ValueError):
  """No usable training text: no files matched, or too few tokens for one row."""


def read_texts(patterns: list[str]) -> list[str]:
  paths = sorted({p for pat in patterns for p in glob.glob(os.path.expanduser(pat))})
  if not paths:
    raise DataError(f"no text files match {patterns}")
  texts = []
  for path in paths:
    with open(path, encoding="utf-8", errors="replace") as f:
      texts.append(f.read())
  return texts


def pack(token_lists: list[list[int]], row_len: int, separator: int | None) -> np.ndarray:
  """[rows, row_len] int32: the documents joined (separator between them), cut into rows."""
  joined: list[int] = []
  for ids in token_lists:
    joined.extend(ids)
    if separator is not None:
      joined.append(separator)
  n_rows = len(joined) // row_len
  if n_rows == 0:
    raise DataError(f"{len(joined)} tokens do not fill one row of {row_len}")
  return np.asarray(joined[:n_rows * row_len], np.int32).reshape(n_rows, row_len)


def split(rows: np.ndarray, heldout: float) -> tuple[np.ndarray, np.ndarray]:
  n_held = max(1, int(round(len(rows) * heldout)))
  if n_held >= len(rows):
    raise DataError(f"{len(rows)} rows leave nothing to train on after holding out {n_held}")
  return rows[:-n_held], rows[-n_held:]


class Batches:
  """Rows for step i: each epoch a fresh permutation (seed + epoch); epochs run back to back."""

  def __init__(self, rows: np.ndarray, batch: int, seed: int):
    self.rows, self.batch, self.seed = rows, batch, seed
    if batch > len(rows):
      raise DataError(f"global batch {batch} is larger than the {len(rows)} training rows")

  def _order(self, epoch: int) -> np.ndarray:
    return np.random.default_rng([self.seed, epoch]).permutation(len(self.rows))

  def __call__(self, step: int) -> np.ndarray:
    """[batch, row_len] rows of step `step` (steps count from 0)."""
    per_epoch = len(self.rows) // self.batch
    epoch, i = divmod(step, per_epoch)
    return self.rows[self._order(epoch)[i * self.batch:(i + 1) * self.batch]]


def load(patterns: list[str], tokenizer, row_len: int, heldout: float):
  """(train rows, held-out rows) from the files matching `patterns`."""
  eos = tokenizer.token_id(tokenizer.eos_token)
  ids = [tokenizer.encode(t) for t in read_texts(patterns)]
  return split(pack(ids, row_len, eos), heldout)
