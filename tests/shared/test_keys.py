from __future__ import annotations

from shared.keys import generate_key, hash_key, key_matches, parse_prefix


def test_generated_keys_are_unique_and_parse() -> None:
    keys = [generate_key() for _ in range(50)]
    assert len({k.plaintext for k in keys}) == 50
    for key in keys:
        assert key.plaintext.startswith("kvl_")
        assert parse_prefix(key.plaintext) == key.prefix
        assert key_matches(key.plaintext, key.hash)
        assert key.hash == hash_key(key.plaintext)
        assert key.plaintext not in key.hash


def test_malformed_keys_have_no_prefix() -> None:
    key = generate_key()
    for bad in [
        "",
        "kvl_",
        key.plaintext[:-1],
        key.plaintext + "x",
        "Bearer " + key.plaintext,
        "kvl_ab_cd",
    ]:
        assert parse_prefix(bad) is None


def test_a_different_secret_does_not_match() -> None:
    key = generate_key()
    forged = key.plaintext[:-1] + ("a" if key.plaintext[-1] != "a" else "b")
    assert parse_prefix(forged) == key.prefix
    assert not key_matches(forged, key.hash)
