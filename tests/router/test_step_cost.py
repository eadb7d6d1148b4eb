"""The one step cost model: the sums an engine keeps fit the law its steps follow."""

from __future__ import annotations

import random

import numpy as np
import pytest

from router.step_cost import GRAM_SIZE, StepShape, StepSums, fit_linear, gram_matrix, linear_seconds

TRUE = (2e-3, 5e-6, 1e-9, 4e-5, 3e-4)


def _shapes(rng: random.Random, count: int) -> list[StepShape]:
    shapes = []
    for _ in range(count):
        if rng.random() < 0.5:  # a decode batch
            seqs = rng.randint(1, 64)
            shapes.append(StepShape(seqs, seqs * rng.randint(100, 4000), seqs, seqs))
        else:  # a prefill chunk, with some decodes
            chunk, context, seqs = rng.randint(64, 2048), rng.randint(0, 8000), rng.randint(0, 16)
            shapes.append(StepShape(chunk + seqs, chunk * context + chunk * (chunk + 1) // 2 + seqs * 1000,
                                    seqs + 1, seqs + rng.randint(0, 1)))
    return shapes


def test_the_sums_are_the_gram_triangle_and_the_moments():
    shapes, seconds = _shapes(random.Random(3), 20), [0.25 * k for k in range(20)]
    sums = StepSums()
    for shape, taken in zip(shapes, seconds):
        sums.record(shape, taken)
    vectors = np.array([shape.vector() for shape in shapes])
    assert np.array_equal(gram_matrix(sums.gram), vectors.T @ vectors)
    assert np.array_equal(np.array(sums.moments), vectors.T @ np.array(seconds))


def test_the_sums_fit_the_law_the_steps_follow():
    rng = random.Random(0)
    sums = StepSums()
    for shape in _shapes(rng, 400):
        sums.record(shape, linear_seconds(TRUE, shape.vector()))
    fitted = fit_linear(gram_matrix(sums.gram), np.array(sums.moments))
    assert fitted == pytest.approx(TRUE, rel=1e-4)


def test_a_term_that_would_come_out_negative_is_dropped_and_the_rest_refit():
    sums = StepSums()
    for tokens in range(1, 50):  # time falls with pairs: a negative per-pair term, which the fit refuses
        shape = StepShape(tokens, tokens * 1000 * (tokens % 7 + 1), 1, 1)
        sums.record(shape, 1e-3 + 1e-5 * tokens - 1e-9 * shape.attn_pairs)
    fitted = fit_linear(gram_matrix(sums.gram), np.array(sums.moments))
    assert (fitted >= 0).all() and fitted[2] == 0


def test_no_step_fits_nothing_and_a_wrong_triangle_is_refused():
    assert fit_linear(gram_matrix([0.0] * GRAM_SIZE), np.zeros(5)) is None
    with pytest.raises(ValueError, match="15 entries"):
        gram_matrix([1.0] * 14)
