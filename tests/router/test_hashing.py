import hashlib
import subprocess
import sys

import msgpack
import pytest

from router.hashing import HASH_NUM_BYTES, ROOT_HASH, hash_block, hash_block_tokens


def test_block_hash_is_blake2b_of_msgpack_triple():
    expected = hashlib.blake2b(msgpack.packb([ROOT_HASH, [1, 2, 3], []]), digest_size=8).digest()
    assert hash_block(ROOT_HASH, [1, 2, 3]) == expected
    assert len(expected) == HASH_NUM_BYTES


def test_hashes_chain_only_full_blocks_and_extend_incrementally():
    tokens = list(range(10))
    hashes = hash_block_tokens(tokens, 4)
    assert len(hashes) == 2
    assert hashes[0] == hash_block(ROOT_HASH, [0, 1, 2, 3])
    assert hashes[1] == hash_block(hashes[0], [4, 5, 6, 7])
    assert hash_block_tokens(tuple(tokens), 4) == hashes  # a tuple's blocks hash as a list's
    assert hash_block_tokens(tokens + [10, 11], 4, parent_hash=hashes[1], start_block=2) == [
        hash_block(hashes[1], [8, 9, 10, 11])
    ]
    # A different first block changes every later hash.
    assert hash_block_tokens([99] + tokens[1:], 4)[1] != hashes[1]


@pytest.mark.integration  # a child Python
def test_hashes_are_identical_in_another_process():
    code = "from router.hashing import hash_block_tokens; print(hash_block_tokens(list(range(64)), 16)[-1].hex())"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert other == hash_block_tokens(list(range(64)), 16)[-1].hex()
