"""Prefix-cache block keys: chained SHA-256 digests, never Python's hash().

A block may be shared only when the whole token prefix up to its end (and the
request's cache_salt) is identical; these tests force the collisions that Python's
hash() allows and check that no block is shared because of them."""

from __future__ import annotations

import builtins

from hypothesis import given, settings
from hypothesis import strategies as st

from tokenloom.core.kv_cache import KVCacheManager, hash_block, root_key
from tokenloom.request import Request
from tokenloom.sampling_params import SamplingParams

BS = 4


def _request(rid: str, prompt: list[int], salt: str | None = None) -> Request:
    return Request(rid, list(prompt), SamplingParams(max_tokens=1), 0.0, max_tokens=1, cache_salt=salt)


def _prefill(kv: KVCacheManager, req: Request) -> int:
    """Admit req as the scheduler does (prefix hit + allocation), compute its whole
    prompt, publish its full blocks and free it; returns the tokens it found cached."""
    hit = kv.find_cached_prefix(req)
    cached = hit.num_tokens(kv.block_size)
    req.num_computed_tokens = cached
    assert kv.allocate(req, req.num_tokens - cached, hit)
    req.num_computed_tokens = req.num_tokens
    kv.cache_full_blocks(req)
    kv.free(req)
    return cached


def test_equal_python_hashes_of_ints_share_no_block():
    """hash(-1) == hash(-2), so hash((parent, (-1,)*4, salt)) == hash((parent, (-2,)*4, salt)):
    with keys built from hash(), b's second block found a's second block (computed after
    other tokens) through a chain that only collided."""
    assert hash(-1) == hash(-2)
    kv = KVCacheManager(num_blocks=32, block_size=BS)
    c = [-2] * BS + [6] * BS + [0]
    a = [-1] * BS + [5] * BS + [0]
    b = [-2] * BS + [5] * BS + [0]
    assert _prefill(kv, _request("c", c)) == 0
    assert _prefill(kv, _request("a", a)) == 0
    assert _prefill(kv, _request("b", b)) == BS  # only the block it truly shares with c


def test_a_forced_hash_collision_on_the_chain_is_a_miss(monkeypatch):
    """Make Python's hash() of every 3-tuple ignore all but the block's own tokens, the
    strongest collision the old hash((parent, tokens, salt)) keys could suffer: prefixes
    and salts still never share a block."""
    real_hash = builtins.hash
    monkeypatch.setattr(builtins, "hash", lambda o: real_hash(o[1]) if isinstance(o, tuple) and len(o) == 3 else real_hash(o))
    kv = KVCacheManager(num_blocks=32, block_size=BS)
    assert _prefill(kv, _request("c", [1] * BS + [2] * BS + [0])) == 0
    assert _prefill(kv, _request("a", [3] * BS + [4] * BS + [0])) == 0
    # b shares its first block with c, its second block's tokens (not its prefix) with a
    assert _prefill(kv, _request("b", [1] * BS + [4] * BS + [0])) == BS
    assert _prefill(kv, _request("s", [1] * BS + [2] * BS + [0], salt="tenant-2")) == 0
    assert _prefill(kv, _request("again", [1] * BS + [2] * BS + [0])) == 2 * BS


def test_keys_are_digests_chained_over_parent_tokens_and_salt():
    root = root_key(None)
    assert len(root) == 32 and root != root_key("") and root_key("x") != root_key("y")
    k = hash_block(root, [1, 2, 3, 4])
    assert isinstance(k, bytes) and len(k) == 32
    assert k == hash_block(root, (1, 2, 3, 4))  # list or tuple: same bytes
    assert k != hash_block(root_key("x"), [1, 2, 3, 4])
    assert hash_block(k, [5, 6, 7, 8]) != hash_block(hash_block(root, [1, 2, 3, 5]), [5, 6, 7, 8])
    assert hash_block(root, [-1]) != hash_block(root, [-2])
    assert hash_block(root, [1, 0]) != hash_block(root, [1 << 32])  # fixed-width packing: no ambiguity


_prompts = st.lists(st.integers(0, 2), min_size=1, max_size=40)  # tiny alphabet: long common prefixes


@settings(max_examples=200, deadline=None)
@given(_prompts, _prompts, st.sampled_from([None, "", "t1"]), st.sampled_from([None, "", "t1"]), st.booleans())
def test_two_prompts_share_exactly_their_common_full_block_prefix(a, b, salt_a, salt_b, constant_hash):
    real_hash = builtins.hash
    if constant_hash:  # every Python hash equal: must change nothing
        builtins.hash = lambda o: 0
    try:
        kv = KVCacheManager(num_blocks=64, block_size=BS)
        _prefill(kv, _request("a", a, salt_a))
        got = _prefill(kv, _request("b", b, salt_b))
    finally:
        builtins.hash = real_hash
    common = 0
    while common < min(len(a), len(b)) and a[common] == b[common]:
        common += 1
    # the last prompt token is always computed, so b can hit at most (len(b) - 1) // BS blocks
    expected = min(common // BS, (len(b) - 1) // BS) * BS if salt_a == salt_b else 0
    assert got == expected
