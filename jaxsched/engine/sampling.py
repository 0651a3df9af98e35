"""On-device sampling: every per-row parameter is an array, so a new value never recompiles.

One row of logits is processed like vLLM V0's sampler, in this order::

    logits[V] --/ temperature --> top-k --> top-p --> min-p --> categorical(key)  -> token
        |                         '-- threshold search: only when a row needs it --'
        '-- log_softmax (raw) at the token ---------------------------------------> logprob

Greedy rows (temperature < 1e-5, vLLM's `_SAMPLING_EPS`) take `argmax` of the raw logits
(lowest id on ties) and ignore their key. Filters work by a per-row threshold on values,
found by bisection over the float order (exact, no sort), so ties at a boundary are all kept.

Reproducibility: the key of a token is a function of (the request's seed, or the request's
identity under the engine key; the sequence's index within the request; the position the
token will take in the sequence) and of nothing else -- not the step, the slot, the batch
row or the other rows in the batch::

    base  = PRNGKey(seed) = (0, seed)                    if the request has a seed
          = (0x9E3779B9 ^ engine seed, request index)    otherwise (input_processor.request_key)
    key   = fold_in(fold_in(base, seq_index), position)  (token_key)

and a row's token depends only on its logits, its parameters and its key. So a sequence
recomputed after a preemption samples exactly the tokens it sampled before. Keys are raw
`uint32[2]` threefry keys (`jax.random.PRNGKey`), which pack into plain arrays.
"""
from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np

SAMPLING_EPS = 1e-5  # vLLM's _SAMPLING_EPS: a temperature below it means greedy


def token_key(base_key: jax.Array, seq_index: jax.Array, position: jax.Array) -> jax.Array:
    """fold_in(fold_in(base_key, seq_index), position): the key of one token (uint32[2])."""
    return jax.random.fold_in(jax.random.fold_in(base_key, seq_index), position)


_SIGN = np.uint32(0x80000000)  # the float sign bit


def _ordered_bits(x: jax.Array) -> jax.Array:
    """uint32 values in the order of the float32 values (-0.0 just below +0.0).

    Thresholds found on these are applied with float `>=`, which treats -0.0, +0.0 and (XLA:CPU
    flushes them) subnormals as one value: such near-ties are all kept, like exact ties.
    """
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    return jnp.where(bits >= _SIGN, ~bits, bits | _SIGN)


def _bits_to_float(ordered: jax.Array) -> jax.Array:
    """Inverse of `_ordered_bits`."""
    bits = jnp.where(ordered >= _SIGN, ordered ^ _SIGN, ~ordered)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _largest_bits(ordered: jax.Array, holds) -> jax.Array:
    """uint32[R]: per row the largest t with holds(t), for `holds` monotone (true, then false).

    `ordered` is uint32[R, V] from `_ordered_bits`. 32 halvings of the uint32 range, so exact:
    holds(t) only changes at the row's own values, so the answer is one of them. The search
    starts at the row's smallest value, assumed to hold (it is the row's full set), so even a
    rounding surprise yields a real value, never a NaN bit pattern.
    """
    def halve(_, bounds):
        lo, hi = bounds
        mid = lo + ((hi - lo) >> 1) + ((hi - lo) & 1)  # ceil midpoint, no uint32 overflow
        ok = holds(mid[:, None])
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid - 1)
    bounds = (jnp.min(ordered, axis=-1), jnp.max(ordered, axis=-1))
    return jax.lax.fori_loop(0, 32, halve, bounds)[0]


def _top_k_top_p_threshold(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """float32[R]: the smallest scaled logit that survives top-k then top-p.

    top-k keeps values >= the k-th largest (ties kept). top-p then keeps the smallest set of
    largest values whose mass under the renormalised top-k distribution is >= p (vLLM V0
    applies top-p after top-k, on the renormalised remainder), so the max always stays.
    """
    v = scaled.shape[-1]
    ordered = _ordered_bits(scaled)
    k = jnp.where((top_k <= 0) | (top_k >= v), v, top_k)
    # NOTE: a bisection over the float order instead of a sort: 2 x 32 masked reductions of
    # [R, V], exact since the threshold is one of the row's own values. Measured on 2 CPU cores,
    # R=32, V=49152: one search ~15 ms against ~310 ms for the sort; all of `sample` with
    # top-k/top-p ~3x faster, with the same tokens.
    thr_k = _largest_bits(ordered, lambda t: jnp.sum(ordered >= t, axis=-1) >= k)
    probs = jnp.where(ordered >= thr_k[:, None],
                      jnp.exp(scaled - jnp.max(scaled, axis=-1, keepdims=True)), 0.0)
    need = top_p * jnp.sum(probs, axis=-1)
    thr_p = _largest_bits(
        ordered, lambda t: jnp.sum(jnp.where(ordered >= t, probs, 0.0), axis=-1) >= need)
    # NOTE: p == 1 must keep everything; a rounded mass can fall short of 1 * total, so a
    # disabled row skips top-p outright. max(): top-p only ever narrows the top-k set.
    thr = jnp.where(top_p < 1, jnp.maximum(thr_k, thr_p), thr_k)
    return _bits_to_float(thr)


def filter_logits(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array,
                  min_p: jax.Array) -> jax.Array:
    """Mask to -inf what top-k, top-p and min-p drop from temperature-scaled logits [R, V]."""
    v = scaled.shape[-1]
    needs_search = jnp.any(((top_k > 0) & (top_k < v)) | (top_p < 1))
    # NOTE: the search is the costly step (64 passes over [R, V]; V = 49152 for SmolLM2), so
    # batches with no top-k/top-p row skip it. A row with both disabled gets its smallest value
    # (keep all) from one branch and -inf from the other: the same mask, so a row's output never
    # depends on its neighbours. Under vmap, cond becomes a select and both branches run.
    thr = jax.lax.cond(needs_search, _top_k_top_p_threshold,
                       lambda s, k, p: jnp.full(s.shape[:1], -jnp.inf, s.dtype),
                       scaled, top_k, top_p)
    kept = jnp.where(scaled >= thr[:, None], scaled, -jnp.inf)
    # min-p: prob < min_p * max_prob  <=>  exp(logit - max_logit) < min_p (no normalisation).
    row_max = jnp.max(kept, axis=-1, keepdims=True)
    return jnp.where(jnp.exp(kept - row_max) < min_p[:, None], -jnp.inf, kept)


def sample(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
           min_p: jax.Array, keys: jax.Array, want_logprobs: bool = True
           ) -> tuple[jax.Array, jax.Array]:
    """Sample one token per row. Jittable; only `want_logprobs` is static.

    Args:
      logits: float[R, V] raw model logits.
      temperature, top_p, min_p: float32[R];  top_k: int32[R]  (see SamplingArrays).
      keys: uint32[R, 2] (or typed keys[R]): each row's `token_key`.
      want_logprobs: False skips the logsumexp and returns zeros.
    Returns:
      tokens int32[R]; logprobs float32[R] = log_softmax(raw logits)[token]. NOTE: raw, like
      vLLM V1's default `raw_logprobs`; V0 returned the processed (scaled, filtered) ones.
    """
    logits = logits.astype(jnp.float32)
    is_greedy = temperature < SAMPLING_EPS
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # first max: lowest id on ties

    def random_rows():
        scaled = logits / jnp.where(is_greedy, 1.0, temperature)[:, None]
        filtered = filter_logits(scaled, top_k, top_p, min_p)
        return jax.vmap(jax.random.categorical)(keys, filtered).astype(jnp.int32)

    # An all-greedy batch skips the [R, V] Gumbel noise as well as the threshold search.
    sampled = jax.lax.cond(jnp.all(is_greedy), lambda: greedy, random_rows)
    tokens = jnp.where(is_greedy, greedy, sampled)
    if not want_logprobs:
        return tokens, jnp.zeros(tokens.shape, jnp.float32)
    picked = jnp.take_along_axis(logits, tokens[:, None], axis=-1)[:, 0]
    return tokens, picked - jax.nn.logsumexp(logits, axis=-1)


def apply_penalties(logits: jax.Array, prompt_tokens: jax.Array, seq_tokens: jax.Array,
                    prompt_len: jax.Array, seq_len: jax.Array, presence: jax.Array,
                    frequency: jax.Array, repetition: jax.Array) -> jax.Array:
    """vLLM V0's `_apply_penalties` on raw logits [R, V], before temperature and the filters.

    Repetition (CTRL's: positive logits / r, negative * r) applies to every token seen in the
    prompt or the output; then frequency (* count) and presence (* seen) are subtracted for
    output tokens. The counts are made here from the sequences' own token buffers
    (`prompt_tokens`, `seq_tokens`: int32[R, L]; positions < prompt_len are the prompt, the
    rest up to seq_len the output), so the engine keeps no extra per-vocabulary state and a new
    penalty value is only new array contents: it never recompiles. Rows with all three off
    are unchanged, and a batch with none on skips the [R, V] work.
    """
    def penalize(logits):
        r, v = logits.shape
        rows = jnp.arange(r)[:, None]
        idx = jnp.arange(seq_tokens.shape[1])[None, :]
        in_prompt = idx < prompt_len[:, None]
        in_output = ~in_prompt & (idx < seq_len[:, None])
        counts = jnp.zeros((r, v), jnp.float32).at[rows, seq_tokens].add(in_output.astype(jnp.float32))
        seen = (jnp.zeros((r, v), jnp.int32).at[rows, prompt_tokens].max(in_prompt.astype(jnp.int32)) > 0
                ) | (counts > 0)
        rep = repetition[:, None]
        logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
        return logits - frequency[:, None] * counts - presence[:, None] * (counts > 0)

    logits = logits.astype(jnp.float32)
    active = jnp.any((presence != 0) | (frequency != 0) | (repetition != 1))
    return jax.lax.cond(active, penalize, lambda x: x, logits)


def top_logprobs(logits: jax.Array, num: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """The k most likely tokens of each row and their log-probabilities, best first.

    logits: float[R, V] (after penalties, as the sampled token's logprob); num: int32[R] how
    many each row wants (the host keeps that many); k: static, the most any row may want.
    A batch where no row wants any skips the [R, V] top-k and returns zeros.
    """
    def compute(logits):
        lp, ids = jax.lax.top_k(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1), k)
        return ids.astype(jnp.int32), lp

    def none(logits):
        return jnp.zeros((logits.shape[0], k), jnp.int32), jnp.zeros((logits.shape[0], k), jnp.float32)
    return jax.lax.cond(jnp.any(num > 0), compute, none, logits)
