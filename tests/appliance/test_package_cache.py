from __future__ import annotations

import hashlib
import json
import os
import tempfile
import threading
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from appliance.packages.cache import (
    EMPTY_HEX,
    CacheError,
    CorruptBlobError,
    NotCachedError,
    PackageCache,
)
from appliance.packages.model import (
    Manifest,
)
from tests.budget import tries
from tests.packages import package
from tests.shared.oci_shapes import (
    APPLIANCE_TAKES,
    INDEX,
    SHAPES,
    rewrap,
    sparse_member,
    with_last_member,
)

BIG = 10**9
REF = "org.opencontainers.image.ref.name"
SHARED_AUDIO = b"RIFF shared intro narration" * 40


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def key(n: int) -> str:
    return f"key-{n}"


def blob_dir(root: Path) -> Path:
    return root / "blobs" / "sha256"


def blob_sizes(root: Path, ref: str) -> dict[str, int]:
    """The blobs index.json says ``ref`` uses, read from disk alone."""
    (entry,) = [
        d
        for d in json.loads((root / "index.json").read_bytes())["manifests"]
        if d["annotations"][REF] == ref
    ]
    oci = json.loads((blob_dir(root) / entry["digest"].removeprefix("sha256:")).read_bytes())
    descriptors = [entry, oci["config"], *oci["layers"]]
    return {d["digest"].removeprefix("sha256:"): d["size"] for d in descriptors}


def assert_layout_sound(root: Path) -> None:
    """Every blob is named by its digest, and every index entry has all its blobs."""
    for blob in blob_dir(root).iterdir():
        assert hashlib.sha256(blob.read_bytes()).hexdigest() == blob.name
    index = json.loads((root / "index.json").read_bytes())
    for entry in index["manifests"]:
        for hex_digest, size in blob_sizes(root, entry["annotations"][REF]).items():
            assert (blob_dir(root) / hex_digest).stat().st_size == size


def test_layout_is_an_oci_image_layout(tmp_path: Path) -> None:
    manifest, files = package(1, files={"items.json": b"[]", "audio/q1.wav": SHARED_AUDIO})
    cache = PackageCache(tmp_path, max_bytes=BIG)
    stored = cache.put(manifest, files, key(1))

    assert json.loads((tmp_path / "oci-layout").read_bytes()) == {"imageLayoutVersion": "1.0.0"}
    index = json.loads((tmp_path / "index.json").read_bytes())
    assert index["schemaVersion"] == 2
    assert index["mediaType"] == "application/vnd.oci.image.index.v1+json"
    (entry,) = index["manifests"]
    assert entry["mediaType"] == "application/vnd.oci.image.manifest.v1+json"
    assert entry["digest"] == stored.digest
    assert entry["annotations"] == {
        REF: f"{manifest.id}@{manifest.version}",
        "dev.kovenlab.package.id": manifest.id,
        "dev.kovenlab.package.version": manifest.version,
        "dev.kovenlab.cache-key": key(1),
        "dev.kovenlab.pinned": "false",
        "dev.kovenlab.last-used": stored.last_used.isoformat(),
        "org.opencontainers.image.created": manifest.created_at,
    }
    oci = json.loads((blob_dir(tmp_path) / stored.digest.removeprefix("sha256:")).read_bytes())
    assert oci["schemaVersion"] == 2
    assert oci["mediaType"] == "application/vnd.oci.image.manifest.v1+json"
    assert oci["artifactType"] == "application/vnd.kovenlab.package.v1+json"
    assert oci["config"] == {
        "mediaType": "application/vnd.oci.empty.v1+json",
        "digest": f"sha256:{EMPTY_HEX}",
        "size": 2,
    }
    assert (blob_dir(tmp_path) / EMPTY_HEX).read_bytes() == b"{}"
    titles = [layer["annotations"]["org.opencontainers.image.title"] for layer in oci["layers"]]
    assert titles == ["manifest.json", "items.json", "audio/q1.wav"]
    assert [layer["mediaType"] for layer in oci["layers"]] == [
        "application/vnd.kovenlab.package.manifest.v1+json",
        "application/json",
        "audio/wav",
    ]
    own = blob_dir(tmp_path) / oci["layers"][0]["digest"].removeprefix("sha256:")
    assert Manifest.model_validate_json(own.read_bytes()) == manifest
    assert blob_dir(tmp_path).joinpath(oci["layers"][2]["digest"][7:]).read_bytes() == SHARED_AUDIO
    assert_layout_sound(tmp_path)
    assert stored.size == cache.total_bytes() == sum(blob_sizes(tmp_path, stored.ref).values())


def test_put_get_by_key_and_open_file_round_trip(tmp_path: Path) -> None:
    cache = PackageCache(tmp_path, max_bytes=BIG)
    manifest, files = package(1)
    stored = cache.put(manifest, files, key(1))

    assert cache.get(manifest.id, manifest.version) == stored
    assert cache.get(manifest.id).manifest == manifest
    hit = cache.by_key(key(1))
    assert hit is not None
    assert (hit.id, hit.version, hit.cache_key, hit.pinned) == (
        manifest.id,
        manifest.version,
        key(1),
        False,
    )
    assert cache.by_key("another request") is None
    entry, path = cache.open_file(manifest.id, None, "items.json")
    assert entry == manifest.files[0]
    assert path.read_bytes() == files["items.json"]
    entry, path = cache.open_file(manifest.id, manifest.version, "manifest.json")
    assert entry.media_type == "application/vnd.kovenlab.package.manifest.v1+json"
    assert Manifest.model_validate_json(path.read_bytes()) == manifest
    with pytest.raises(NotCachedError):
        cache.open_file(manifest.id, None, "missing.json")
    with pytest.raises(NotCachedError):
        cache.get(manifest.id, "ffffffffffff")
    with pytest.raises(NotCachedError):
        cache.get("pkg_unknown")


def test_get_without_version_is_the_newest(tmp_path: Path) -> None:
    cache = PackageCache(tmp_path, max_bytes=BIG)
    cache.put(*package(1, version="aaaaaaaaaaaa", day=9), key(1))
    cache.put(*package(1, version="bbbbbbbbbbbb", day=3), key(2))
    assert cache.get(package(1)[0].id).version == "aaaaaaaaaaaa"


def test_a_repeated_key_is_a_hit_that_marks_the_package_used(tmp_path: Path) -> None:
    clock = Clock()
    cache = PackageCache(tmp_path, max_bytes=BIG, clock=clock)
    put = cache.put(*package(1), key(1))
    clock.advance(120)
    first = cache.by_key(key(1))
    clock.advance(5)
    second = cache.by_key(key(1))
    assert first is not None
    assert second is not None
    assert first.digest == second.digest == put.digest
    assert put.last_used < first.last_used < second.last_used


def test_put_verifies_files_against_the_manifest(tmp_path: Path) -> None:
    cache = PackageCache(tmp_path, max_bytes=BIG)
    manifest, files = package(1)
    with pytest.raises(CacheError, match=r"items\.json"):
        cache.put(manifest, {"items.json": b"tampered"}, key(1))
    with pytest.raises(CacheError, match="differ"):
        cache.put(manifest, {}, key(1))
    with pytest.raises(CacheError, match=r"manifest\.json"):
        cache.put(*package(2, files={"manifest.json": b"{}"}), key(2))
    with pytest.raises(CacheError, match="ISO 8601"):
        cache.put(manifest.model_copy(update={"created_at": "yesterday"}), files, key(1))
    assert cache.list() == []
    assert cache.total_bytes() == 0


def test_a_version_is_immutable_and_an_identical_put_is_a_no_op(tmp_path: Path) -> None:
    clock = Clock()
    cache = PackageCache(tmp_path, max_bytes=BIG, clock=clock)
    manifest, files = package(1)
    first = cache.put(manifest, files, key(1))
    blobs = {p.name: p.stat().st_mtime_ns for p in blob_dir(tmp_path).iterdir()}

    clock.advance(10)
    assert cache.put(manifest, files, key(1)) == first
    assert {p.name: p.stat().st_mtime_ns for p in blob_dir(tmp_path).iterdir()} == blobs

    other, other_files = package(1, files={"items.json": b"different items"})
    with pytest.raises(CacheError, match="immutable"):
        cache.put(other, other_files, key(1))
    with pytest.raises(CacheError, match="immutable"):
        cache.put(manifest, files, "another key")
    assert cache.get(manifest.id, manifest.version) == first


def test_eviction_removes_the_least_recently_used_unpinned_package(tmp_path: Path) -> None:
    clock = Clock()
    probe = PackageCache(tmp_path / "probe", max_bytes=BIG)
    size = max(probe.put(*package(n), key(n)).size for n in range(1, 5))
    cache = PackageCache(tmp_path / "cache", max_bytes=2 * size + size // 2, clock=clock)
    a, b, c, d = (package(n) for n in range(1, 5))

    cache.put(*a, key(1))
    clock.advance(10)
    cache.put(*b, key(2))
    clock.advance(10)
    assert cache.by_key(key(1)) is not None  # a is now used more recently than b
    clock.advance(10)
    cache.put(*c, key(3))
    assert {p.id for p in cache.list()} == {a[0].id, c[0].id}

    cache.pin(a[0].id, a[0].version, pinned=True)  # least recently used, but pinned
    clock.advance(10)
    cache.put(*d, key(4))
    assert {p.id for p in cache.list()} == {a[0].id, d[0].id}
    assert cache.total_bytes() <= cache.max_bytes
    assert cache.evict() == []
    assert_layout_sound(tmp_path / "cache")


def test_pinned_packages_stay_even_when_they_alone_exceed_the_cap(tmp_path: Path) -> None:
    clock = Clock()
    cache = PackageCache(tmp_path, max_bytes=100, clock=clock)
    one = cache.put(*package(1), key(1))  # over the cap alone, yet kept: it was just put
    assert cache.total_bytes() > cache.max_bytes
    cache.pin(one.id, one.version, pinned=True)
    clock.advance(10)
    two = cache.put(*package(2), key(2))
    assert [p.ref for p in cache.list()] == [two.ref, one.ref]

    assert cache.evict() == [two.ref]
    assert [p.ref for p in cache.list()] == [one.ref]
    assert cache.get(one.id).pinned

    cache.pin(one.id, one.version, pinned=False)
    assert cache.evict() == [one.ref]
    assert cache.total_bytes() == 0
    assert list(blob_dir(tmp_path).iterdir()) == []


def test_shared_blobs_are_counted_once_and_kept_while_referenced(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    cache = PackageCache(root, max_bytes=BIG)
    a = cache.put(*package(1, files={"audio/intro.wav": SHARED_AUDIO}), key(1))
    b = cache.put(*package(2, files={"audio/intro.wav": SHARED_AUDIO}), key(2))
    both = blob_sizes(root, a.ref) | blob_sizes(root, b.ref)
    assert cache.total_bytes() == sum(both.values()) < a.size + b.size
    shared = hashlib.sha256(SHARED_AUDIO).hexdigest()

    exact = PackageCache(tmp_path / "exact", max_bytes=cache.total_bytes())
    for n in (1, 2):  # both fit exactly: counting the shared blob twice would evict one
        exact.put(*package(n, files={"audio/intro.wav": SHARED_AUDIO}), key(n))
    assert {p.ref for p in exact.list()} == {a.ref, b.ref}

    cache.delete(a.id, a.version)
    assert (blob_dir(root) / shared).exists()
    _, path = cache.open_file(b.id, b.version, "audio/intro.wav")
    assert path.read_bytes() == SHARED_AUDIO
    assert cache.total_bytes() == b.size

    cache.delete(b.id, b.version)
    assert not (blob_dir(root) / shared).exists()
    with pytest.raises(NotCachedError):
        cache.delete(b.id, b.version)


def test_eviction_frees_a_shared_blob_only_with_its_last_user(tmp_path: Path) -> None:
    clock = Clock()
    probe = PackageCache(tmp_path / "probe", max_bytes=BIG)
    audio = {"audio/intro.wav": SHARED_AUDIO}
    a, b, c = package(1, files=audio), package(2, files=audio), package(3)
    for n, (manifest, files) in enumerate([b, c], start=2):
        probe.put(manifest, files, key(n))
    cache = PackageCache(tmp_path / "cache", max_bytes=probe.total_bytes() - 1, clock=clock)
    for n, (manifest, files) in enumerate([a, b, c], start=1):
        cache.put(manifest, files, key(n))
        clock.advance(10)
    # Evicting a frees little (b still uses the audio), so b must go too.
    assert [p.id for p in cache.list()] == [c[0].id]
    assert_layout_sound(tmp_path / "cache")


def test_a_corrupt_blob_is_detected_and_never_served(tmp_path: Path) -> None:
    cache = PackageCache(tmp_path, max_bytes=BIG)
    manifest, files = package(1)
    stored = cache.put(manifest, files, key(1))
    _, path = cache.open_file(manifest.id, None, "items.json")  # verified once, remembered
    assert cache.verify() == []

    stat = path.stat()
    path.write_bytes(b"X" * stat.st_size)  # same size: only the content differs
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    with pytest.raises(CorruptBlobError):
        cache.open_file(manifest.id, None, "items.json")
    assert cache.verify() == [stored.ref]

    # Putting a package that holds the same file rewrites the damaged blob.
    cache.put(*package(2, files=files), key(2))
    assert cache.open_file(manifest.id, None, "items.json")[1].read_bytes() == files["items.json"]
    assert cache.verify() == []

    path.unlink()
    with pytest.raises(CorruptBlobError):
        cache.open_file(manifest.id, None, "items.json")
    assert sorted(cache.verify()) == sorted([stored.ref, cache.get(package(2)[0].id).ref])


def test_a_restarted_cache_sees_everything(tmp_path: Path) -> None:
    clock = Clock()
    cache = PackageCache(tmp_path, max_bytes=BIG, clock=clock)
    for n in range(1, 4):
        cache.put(*package(n), key(n))
    pinned = cache.pin(package(2)[0].id, package(2)[0].version, pinned=True)
    clock.advance(3600)
    used = cache.by_key(key(3))
    before = cache.list()

    again = PackageCache(tmp_path, max_bytes=BIG, clock=clock)
    assert again.list() == before
    assert again.get(pinned.id).pinned
    assert again.by_key(key(3)) == used
    assert (
        again.open_file(pinned.id, None, "items.json")[1].read_bytes()
        == package(2)[1]["items.json"]
    )
    assert again.total_bytes() == cache.total_bytes()


def test_an_unreadable_index_is_moved_aside_and_rebuilt_from_the_blobs(tmp_path: Path) -> None:
    cache = PackageCache(tmp_path, max_bytes=BIG)
    for n in range(1, 3):
        cache.put(*package(n), key(n))
    cache.pin(package(1)[0].id, package(1)[0].version, pinned=True)
    (tmp_path / "index.json").write_text("{not json")

    again = PackageCache(tmp_path, max_bytes=BIG)
    assert [p.ref for p in again.list()] == [p.ref for p in cache.list()]
    assert again.by_key(key(2)) is not None
    assert not again.get(package(1)[0].id).pinned  # pins live only in the index
    assert [p.name for p in tmp_path.glob("index.json.corrupt-*")] != []
    assert_layout_sound(tmp_path)


def test_leftovers_of_a_crash_are_collected_on_start(tmp_path: Path) -> None:
    cache = PackageCache(tmp_path, max_bytes=BIG)
    stored = cache.put(*package(1), key(1))
    orphan = b"a blob written before a crash, never indexed"
    (blob_dir(tmp_path) / hashlib.sha256(orphan).hexdigest()).write_bytes(orphan)
    (blob_dir(tmp_path) / ".half-written.tmp").write_bytes(b"partial")
    (tmp_path / ".index.json.0123abcd.tmp").write_bytes(b"partial")

    again = PackageCache(tmp_path, max_bytes=BIG)
    assert {p.name for p in blob_dir(tmp_path).iterdir()} == set(blob_sizes(tmp_path, stored.ref))
    assert again.total_bytes() == stored.size
    assert sorted(p.name for p in tmp_path.iterdir()) == ["blobs", "index.json", "oci-layout"]


def test_list_searches_id_title_and_topic_newest_first_with_paging(tmp_path: Path) -> None:
    cache = PackageCache(tmp_path, max_bytes=BIG)
    topics = ["Photosynthesis", "Cell respiration", "photosynthesis in algae", "Volcanoes"]
    for n, topic in enumerate(topics, start=1):
        cache.put(*package(n, topic=topic), key(n))

    assert [p.manifest.topic for p in cache.list()] == topics[::-1]
    assert [p.manifest.topic for p in cache.list(query="PHOTOSYNTHESIS")] == [
        "photosynthesis in algae",
        "Photosynthesis",
    ]
    assert [p.manifest.title for p in cache.list(query="lesson 2")] == ["Lesson 2"]
    assert [p.id for p in cache.list(query=package(4)[0].id)] == [package(4)[0].id]
    assert cache.list(query="nothing like it") == []
    assert [p.manifest.topic for p in cache.list(limit=2, offset=1)] == topics[2:0:-1]
    assert cache.list(offset=10) == []
    with pytest.raises(ValueError, match="negative"):
        cache.list(limit=-1)


def test_threads_can_share_one_cache(tmp_path: Path) -> None:
    cache = PackageCache(tmp_path, max_bytes=BIG)

    def work(start: int) -> None:
        for n in range(start, start + 5):
            cache.put(*package(n), key(n))
            assert cache.by_key(key(n)) is not None

    threads = [threading.Thread(target=work, args=(start,)) for start in (0, 5, 10, 15)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(cache.list(limit=100)) == 20
    assert cache.verify() == []
    assert len(json.loads((tmp_path / "index.json").read_bytes())["manifests"]) == 20


# Packages for the property test: different sizes, some sharing a file, two versions of one.
POOL = [
    package(n, version=version, files=files, day=n)
    for n, version, files in [
        (0, "000000000001", {"a.json": b"a" * 300, "audio/intro.wav": SHARED_AUDIO}),
        (1, "000000000001", {"b.json": b"b" * 1500}),
        (2, "000000000001", {"c.json": b"c" * 50, "audio/intro.wav": SHARED_AUDIO}),
        (2, "000000000002", {"c.json": b"C" * 50, "audio/intro.wav": SHARED_AUDIO}),
        (3, "000000000001", {}),
    ]
]
OPS = st.one_of(
    st.tuples(st.sampled_from(["put", "touch", "pin", "unpin"]), st.integers(0, len(POOL) - 1)),
    st.just(("evict", 0)),
)


@settings(max_examples=tries(100), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(max_bytes=st.integers(2_000, 12_000), ops=st.lists(OPS, max_size=25))
def test_eviction_keeps_the_cap_and_the_pins_and_never_breaks_the_index(
    max_bytes: int, ops: list[tuple[str, int]]
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        clock = Clock()
        cache = PackageCache(root, max_bytes=max_bytes, clock=clock)
        refs = [f"{m.id}@{m.version}" for m, _ in POOL]
        pinned: set[str] = set()
        for op, i in ops:
            clock.advance(1)
            manifest, files = POOL[i]
            present = {p.ref for p in cache.list(limit=100)}
            must_fit: set[str] | None = None  # after put and evict: what the cap may not drop
            if op == "put":
                cache.put(manifest, files, key(i))
                must_fit = pinned | {refs[i]}  # the package just put is never evicted
            elif op == "evict":
                cache.evict()
                must_fit = set(pinned)
            elif op == "touch":
                assert (cache.by_key(key(i)) is None) == (refs[i] not in present)
            elif refs[i] not in present:
                with pytest.raises(NotCachedError):
                    cache.pin(manifest.id, manifest.version, pinned=op == "pin")
            else:
                cache.pin(manifest.id, manifest.version, pinned=op == "pin")
                (pinned.add if op == "pin" else pinned.discard)(refs[i])

            if must_fit is not None:
                needed: dict[str, int] = {}
                for ref in must_fit:
                    needed |= blob_sizes(root, ref)
                if sum(needed.values()) <= max_bytes:
                    assert cache.total_bytes() <= max_bytes
            assert pinned == {p.ref for p in cache.list(limit=100) if p.pinned}
            assert cache.total_bytes() == sum(b.stat().st_size for b in blob_dir(root).iterdir())
            assert_layout_sound(root)


def test_open_blob_serves_the_descriptor_it_checked_and_the_loop_path_never_hashes(
    tmp_path: Path,
) -> None:
    cache = PackageCache(tmp_path, max_bytes=BIG)
    manifest, files = package(1)
    cache.put(manifest, files, key(1))
    # put() writes without reading back; the loop path will not hash, so it defers.
    assert cache.try_open_blob(manifest.id, None, "items.json") is None
    entry, blob = cache.open_blob(manifest.id, None, "items.json")
    with blob:
        assert blob.read() == files["items.json"]  # hashing left it at the start
    assert entry.sha256 == hashlib.sha256(files["items.json"]).hexdigest()
    opened = cache.try_open_blob(manifest.id, manifest.version, "items.json")
    assert opened is not None
    with opened[1]:
        assert opened[1].read() == files["items.json"]

    # Changed on disk: the loop path defers again, and the checking path refuses it.
    path = blob_dir(tmp_path) / entry.sha256
    stat = path.stat()
    path.write_bytes(b"X" * stat.st_size)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    assert cache.try_open_blob(manifest.id, None, "items.json") is None
    with pytest.raises(CorruptBlobError):
        cache.open_blob(manifest.id, None, "items.json")
    path.unlink()
    with pytest.raises(CorruptBlobError):
        cache.try_open_blob(manifest.id, None, "items.json")
    with pytest.raises(NotCachedError):
        cache.try_open_blob(manifest.id, None, "nope.json")


def test_the_loop_path_never_waits_for_the_lock(tmp_path: Path) -> None:
    cache = PackageCache(tmp_path, max_bytes=BIG)
    manifest, files = package(1)
    cache.put(manifest, files, key(1))
    cache.open_blob(manifest.id, None, "items.json")[1].close()
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with cache._lock:  # as a put() of a large package would
            held.set()
            release.wait(10)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        held.wait(10)
        assert cache.try_open_blob(manifest.id, None, "items.json") is None
    finally:
        release.set()
        holder.join()
    opened = cache.try_open_blob(manifest.id, None, "items.json")
    assert opened is not None
    opened[1].close()


def test_a_package_travels_as_an_archive_to_another_cache(tmp_path: Path) -> None:
    source = PackageCache(tmp_path / "a", max_bytes=BIG)
    manifest, files = package(1, files={"items.json": b"[1]", "audio/intro.wav": SHARED_AUDIO})
    stored = source.put(manifest, files, key(1))
    archive = source.bundle(manifest.id)
    assert archive == source.bundle(manifest.id, manifest.version)  # deterministic

    target = PackageCache(tmp_path / "b", max_bytes=BIG)
    imported = target.import_bundle(archive)
    assert (imported.ref, imported.digest, imported.cache_key) == (
        stored.ref, stored.digest, stored.cache_key)  # fmt: skip
    assert target.by_key(key(1)) is not None  # a request there hits it too
    _, blob = target.open_blob(manifest.id, None, "audio/intro.wav")
    with blob:
        assert blob.read() == SHARED_AUDIO
    assert_layout_sound(tmp_path / "b")
    assert target.import_bundle(archive).ref == stored.ref  # again: nothing changes

    spoiled = archive.replace(SHARED_AUDIO, b"X" * len(SHARED_AUDIO))
    with pytest.raises(CacheError):
        PackageCache(tmp_path / "c", max_bytes=BIG).import_bundle(spoiled)
    with pytest.raises(CacheError):
        target.import_bundle(b"not an archive")


def test_an_archive_with_a_sparse_member_is_refused_and_nothing_is_cached(
    tmp_path: Path,
) -> None:
    """A sparse member (a few bytes that read back as 64 GiB) at the end of a genuine
    package archive: the import is refused from the headers, and the cache stays empty."""
    source = PackageCache(tmp_path / "a", max_bytes=BIG)
    manifest, files = package(1)
    source.put(manifest, files, key(1))
    archive = source.bundle(manifest.id)
    hostile = with_last_member(
        archive, sparse_member(f"blobs/sha256/{'b' * 64}", b"zero", 64 << 30)
    )
    target = PackageCache(tmp_path / "b", max_bytes=BIG)
    with pytest.raises(CacheError, match="sparse"):
        target.import_bundle(hostile)
    assert target.list() == []
    assert target.import_bundle(archive).ref == f"{manifest.id}@{manifest.version}"


@pytest.fixture(scope="module")
def seedable(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """A package archive as the hub seeds it to a node (an appliance's own export)."""
    source = PackageCache(tmp_path_factory.mktemp("source"), max_bytes=BIG)
    manifest, files = package(1)
    source.put(manifest, files, key(1))
    return source.bundle(manifest.id)


def test_the_archive_the_shapes_change_is_imported(seedable: bytes, tmp_path: Path) -> None:
    """Unchanged, the archive rewrapped is imported: the refusals below are the shapes'."""
    target = PackageCache(tmp_path, max_bytes=BIG)
    assert target.import_bundle(rewrap(seedable, INDEX, lambda index: index)).ref.startswith("pkg_")


@pytest.mark.parametrize("case", sorted(set(SHAPES) - APPLIANCE_TAKES))
def test_a_seeded_archive_of_the_wrong_shape_is_a_cache_error_and_nothing_is_cached(
    seedable: bytes, tmp_path: Path, case: str
) -> None:
    """What the hub seeds is fetched as an archive (appliance/fleet/placement.py), whose
    seeding refuses a CacheError, and only that: any other exception stopped the round."""
    target_doc, change = SHAPES[case]
    target = PackageCache(tmp_path, max_bytes=BIG)
    with pytest.raises(CacheError):
        target.import_bundle(rewrap(seedable, target_doc, change))
    assert target.list() == []
    assert [p.name for p in blob_dir(tmp_path).iterdir()] == []


def test_removed_refs_are_taken_once(tmp_path: Path) -> None:
    clock = Clock()
    one, files = package(1, files={"items.json": b"x" * 600})
    cache = PackageCache(tmp_path, max_bytes=BIG, clock=clock)
    cache.max_bytes = 2 * cache.put(one, files, key(1)).size + 100  # room for two
    clock.advance(1)
    two, files = package(2, files={"items.json": b"y" * 600})
    cache.put(two, files, key(2))
    clock.advance(1)
    three, files = package(3, files={"items.json": b"z" * 600})
    cache.put(three, files, key(3))
    assert cache.take_removed() == [f"{one.id}@{one.version}"]
    assert cache.take_removed() == []
    cache.delete(two.id, two.version)
    assert cache.take_removed() == [f"{two.id}@{two.version}"]
