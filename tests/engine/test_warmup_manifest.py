"""The kernel manifest (engine/kernel_manifest.py) and the warm-up that writes and replays it
(engine/warmup.py warm_up_kernels), on kernel factory modules built for the test."""

from __future__ import annotations

import dataclasses
import json
import shutil
import threading
import types

import pytest

from converter import synth
from engine.config import EngineConfig, ModelArgs
from engine.kernel_manifest import (KernelCall, ManifestError, built_calls, kernels_source_digest, manifest_key,
                                    manifest_path, read_hints, read_manifest, replay, shape_key, tilelang_cache_dir,
                                    write_manifest)
from engine.warmup import COMPILING, LOADING, PRECOMPILING, KernelManifest, WarmupStep, warm_up_kernels
from kernels.backend import kernel_factories

# A kernels module of the test's own: two factories that log every build (with the building
# thread's name) into LOG, and a function that is no factory.
FAKE_KERNELS = '''
import threading

from kernels.toolkit import kernel_factory

LOG = []


@kernel_factory
def gemv_kernel(m, n, arch, dtype="bfloat16"):
    LOG.append(("gemv_kernel", (m, n, arch), {"dtype": dtype}, threading.current_thread().name))
    return ("gemv", m, n, arch, dtype)


@kernel_factory
def norm_kernel(d, eps, weighted, offs):
    if d < 0:
        raise ValueError(f"no kernel for d={d}\\n  at line 1\\n  at line 2")
    LOG.append(("norm_kernel", (d, eps, weighted, offs), {}, threading.current_thread().name))
    return ("norm", d, eps, weighted, offs)


def not_a_kernel(x):
    return x
'''


def fake_kernels(name: str = "fake_kernels") -> types.ModuleType:
    """A fresh module (a new process's view of the kernels: nothing built yet)."""
    module = types.ModuleType(name)
    exec(compile(FAKE_KERNELS, f"<{name}>", "exec"), module.__dict__)
    return module


def build_some(module: types.ModuleType) -> None:
    """What a full warm-up does to the factories: build kernels of several argument kinds."""
    for m in (1, 2, 4):
        module.gemv_kernel(m, 4096, (9, 0))
    module.gemv_kernel(1, 512, (9, 0), dtype="float16")
    module.norm_kernel(7168, 1e-6, True, (0, 1 << 20, (3, 5)))
    module.norm_kernel(512, 1.5e-7, False, ())


def manifest_for(module: types.ModuleType, cache_dir, key: str = "k" * 32) -> KernelManifest:
    return KernelManifest(manifest_path(cache_dir, key), key, kernel_factories([module]))


def test_the_key_changes_with_each_input():
    args = ModelArgs.from_dict(synth.flash_config(43), "flash")
    config = EngineConfig(prefill_chunk=256, max_seq_len=4096)
    base = dict(args=args, config=config, converted=True, arch=(9, 0), tilelang_version="0.1.15",
                source_digest="a" * 64, resident=True)
    variants = [dict(args=dataclasses.replace(args, n_layers=4)),
                dict(args=dataclasses.replace(args, n_routed_experts=24)),
                dict(args=dataclasses.replace(args, compress_ratios=(0, 0, 128) + args.compress_ratios[3:])),
                dict(config=dataclasses.replace(config, prefill_chunk=128)),
                dict(config=dataclasses.replace(config, max_seq_len=8192)),
                dict(config=dataclasses.replace(config, numerics="exact")),
                dict(config=dataclasses.replace(config, cuda_graphs=False)),
                dict(converted=False), dict(arch=(12, 1)), dict(tilelang_version="0.1.16"),
                dict(source_digest="b" * 64), dict(resident=False),
                dict(plan=(("prefill", 17, 0, 0, 0),))]  # a fixed warm-up plan records a new manifest
    keys = [manifest_key(**base)] + [manifest_key(**{**base, **v}) for v in variants]
    assert len(set(keys)) == len(keys) == 14
    assert manifest_key(**base) == keys[0]  # a digest: the same inputs, the same key
    # fields that pick no kernel keep the key
    same = dataclasses.replace(config, io_threads=2, cache_bytes=1 << 30, cache_policy=config.cache_policy)
    assert manifest_key(**{**base, "config": same}) == keys[0]


def test_the_source_digest_follows_the_kernels_sources(tmp_path):
    from engine.kernel_manifest import KERNELS_DIR

    copy = tmp_path / "kernels"
    shutil.copytree(KERNELS_DIR, copy, ignore=shutil.ignore_patterns("__pycache__"))
    digest = kernels_source_digest(copy)
    assert digest == kernels_source_digest(KERNELS_DIR) and len(digest) == 64
    rope = copy / "rope.py"
    rope.write_text(rope.read_text() + "\n# a change\n")
    assert kernels_source_digest(copy) != digest
    (copy / "rope.py").unlink()
    assert kernels_source_digest(copy) not in (digest, kernels_source_digest(KERNELS_DIR))


def test_the_manifest_lives_in_tilelangs_cache_folder(tmp_path):
    assert tilelang_cache_dir({"TILELANG_CACHE_DIR": str(tmp_path)}) == tmp_path
    assert tilelang_cache_dir({}).parts[-2:] == (".tilelang", "cache")
    assert manifest_path(tmp_path, "abc") == tmp_path / "dsv4-chat-manifests" / "abc.json"


def test_a_manifest_round_trips(tmp_path):
    module = fake_kernels()
    build_some(module)
    factories = kernel_factories([module])
    assert sorted(factories) == ["fake_kernels.gemv_kernel", "fake_kernels.norm_kernel"]
    calls = built_calls(factories)
    assert len(calls) == 6
    assert calls[0] == KernelCall("fake_kernels.gemv_kernel", (1, 4096, (9, 0)))
    assert calls[3] == KernelCall("fake_kernels.gemv_kernel", (1, 512, (9, 0)), (("dtype", "float16"),))
    assert calls[4] == KernelCall("fake_kernels.norm_kernel", (7168, 1e-6, True, (0, 1 << 20, (3, 5))))
    path = manifest_path(tmp_path, "key1")
    write_manifest(path, "key1", calls)
    assert read_manifest(path, "key1", factories) == calls
    body = json.loads(path.read_text())
    assert body["format"] == 1 and body["key"] == "key1" and len(body["kernels"]) == 6
    assert body["kernels"][4] == {"factory": "fake_kernels.norm_kernel",
                                  "args": [7168, 1e-6, True, [0, 1 << 20, [3, 5]]], "kwargs": {}}


@pytest.mark.parametrize("workers", [1, 3])
def test_replay_calls_exactly_the_recorded_factories_with_the_recorded_args(tmp_path, workers):
    first = fake_kernels()
    build_some(first)
    path = manifest_path(tmp_path, "key1")
    write_manifest(path, "key1", built_calls(kernel_factories([first])))

    later = fake_kernels()  # the later process: nothing built
    factories = kernel_factories([later])
    seen = []
    replay(read_manifest(path, "key1", factories), factories, workers,
           lambda done, total: seen.append((done, total, threading.current_thread().name)))
    key = lambda entry: repr(entry[:3])  # noqa: E731  (factory, args, kwargs)
    assert sorted(map(key, later.LOG)) == sorted(map(key, first.LOG)) and len(later.LOG) == 6
    for name in ("gemv_kernel", "norm_kernel"):
        assert sorted(map(repr, getattr(later, name).built())) == sorted(map(repr, getattr(first, name).built()))
    assert [(d, t) for d, t, _ in seen] == [(d, 6) for d in range(7)]
    assert {thread for _, _, thread in seen} == {threading.current_thread().name}  # progress: the caller's
    builders = {entry[3] for entry in later.LOG}
    if workers == 1:
        assert builders == {threading.current_thread().name}
    else:
        assert builders <= {f"kernel-replay-{i}" for i in range(workers)}
    assert not [t for t in threading.enumerate() if t.name.startswith("kernel-replay-")]  # all joined


def test_a_failing_replay_names_the_call_and_leaves_no_thread(tmp_path):
    module = fake_kernels()
    factories = kernel_factories([module])
    calls = [KernelCall("fake_kernels.norm_kernel", (d, 1e-6, True, ())) for d in (64, 128, -1, 256, 512)]
    for workers in (1, 4):
        with pytest.raises(ManifestError, match=r"replaying fake_kernels.norm_kernel\(-1, .*ValueError: no kernel"):
            replay(calls, factories, workers, lambda done, total: None)
        assert not [t for t in threading.enumerate() if t.name.startswith("kernel-replay-")]
    with pytest.raises(ManifestError, match="TypeError"):  # the factory's signature changed
        replay([KernelCall("fake_kernels.gemv_kernel", (1, 2))], factories, 1, lambda done, total: None)
    with pytest.raises(ManifestError) as failed:  # a compiler's pages of output: one line of it
        replay([KernelCall("fake_kernels.norm_kernel", (-2, 0.5, False, ()))], factories, 1, lambda d, t: None)
    assert str(failed.value) == ("replaying fake_kernels.norm_kernel(-2, 0.5, False, ()) failed: "
                                 "ValueError: no kernel for d=-2")


STEPS = [WarmupStep("prefill", tokens=256), WarmupStep("prefill", tokens=1), WarmupStep("decode", capacity=16)]


def full_warm_up(module: types.ModuleType, ran: list):
    """A stand-in for run_warmup over STEPS: building the module's kernels is what the model does."""

    def run(progress):
        ran.append(True)
        for i, step in enumerate(STEPS):
            progress(i, len(STEPS), step.describe())
        build_some(module)
        progress(len(STEPS), len(STEPS), "kernels ready")

    return run


def test_the_first_load_writes_the_manifest_and_a_later_one_replays_it(tmp_path):
    first, ran, events = fake_kernels(), [], []
    replayed = warm_up_kernels(STEPS, full_warm_up(first, ran), manifest_for(first, tmp_path), events.append)
    assert replayed is False and ran == [True]
    assert [(e.phase, e.done, e.total, e.unit) for e in events] == [(COMPILING, d, 3, "shapes") for d in range(4)]
    path = manifest_path(tmp_path, "k" * 32)
    assert read_manifest(path, "k" * 32, kernel_factories([first])) == built_calls(kernel_factories([first]))

    later, ran, events = fake_kernels(), [], []
    replayed = warm_up_kernels(STEPS, full_warm_up(later, ran), manifest_for(later, tmp_path), events.append,
                               workers=2)
    assert replayed is True and ran == []  # no model step ran
    assert [(e.phase, e.done, e.total, e.unit) for e in events] == [(LOADING, d, 6, "kernels") for d in range(7)]
    assert events[-1].message == "kernels ready"
    assert built_calls(kernel_factories([later])) == built_calls(kernel_factories([first]))


def corrupt(path):
    path.write_text('{"format": 1, "key": ')


def other_key(path):
    body = json.loads(path.read_text())
    path.write_text(json.dumps({**body, "key": "another"}))


def unknown_factory(path):
    body = json.loads(path.read_text())
    body["kernels"][0]["factory"] = "fake_kernels.renamed_kernel"
    path.write_text(json.dumps(body))


def stale_args(path):
    body = json.loads(path.read_text())
    body["kernels"][-1]["args"] = [-1, 1e-6, True, []]  # a build that now raises
    path.write_text(json.dumps(body))


@pytest.mark.parametrize("damage, reason", [(corrupt, "cannot be read"), (other_key, "was written for key 'another'"),
                                            (unknown_factory, "unknown kernel factory 'fake_kernels.renamed_kernel'"),
                                            (stale_args, "ValueError: no kernel for d=-1")])
def test_an_unusable_manifest_falls_back_to_the_full_warm_up_with_one_message(tmp_path, damage, reason):
    first = fake_kernels()
    warm_up_kernels(STEPS, full_warm_up(first, []), manifest_for(first, tmp_path), lambda e: None)
    path = manifest_path(tmp_path, "k" * 32)
    damage(path)

    later, ran, events = fake_kernels(), [], []
    replayed = warm_up_kernels(STEPS, full_warm_up(later, ran), manifest_for(later, tmp_path), events.append)
    assert replayed is False and ran == [True]
    messages = [e.message for e in events if "full warm-up" in e.message]
    assert len(messages) == 1 and reason in messages[0] and str(path) in messages[0]
    compiling = [e for e in events if e.phase == COMPILING]
    assert compiling[0].message == messages[0] and [e.done for e in compiling] == [0, 0, 1, 2, 3]
    assert all(e.phase == LOADING for e in events[:len(events) - len(compiling)])  # the replay's, if it began
    # the manifest is rewritten: the next load replays it
    assert read_manifest(path, "k" * 32, kernel_factories([later])) == built_calls(kernel_factories([later]))
    again, ran = fake_kernels(), []
    assert warm_up_kernels(STEPS, full_warm_up(again, ran), manifest_for(again, tmp_path), lambda e: None) is True
    assert ran == []


def test_the_write_is_atomic(tmp_path):
    module = fake_kernels()
    build_some(module)
    calls = built_calls(kernel_factories([module]))
    path = manifest_path(tmp_path, "key1")
    write_manifest(path, "key1", calls[:2])
    before = path.read_bytes()

    # an argument JSON cannot hold: refused before anything is written
    with pytest.raises(ManifestError, match="argument of type object"):
        write_manifest(path, "key1", calls + [KernelCall("fake_kernels.gemv_kernel", (object(),))])
    assert path.read_bytes() == before
    # the rename fails (the target is a folder): the temporary file is removed, the target untouched
    blocked = manifest_path(tmp_path, "key2")
    blocked.mkdir(parents=True)
    with pytest.raises(OSError):
        write_manifest(blocked, "key2", calls)
    assert blocked.is_dir() and not any(blocked.iterdir())
    # a complete write replaces the old manifest whole, leaving only the manifests in the folder
    write_manifest(path, "key1", calls)
    assert read_manifest(path, "key1", kernel_factories([module])) == calls
    assert sorted(p.name for p in path.parent.iterdir()) == ["key1.json", "key2.json"]


def test_a_manifest_that_cannot_be_written_is_reported_and_the_load_goes_on(tmp_path):
    module, events = fake_kernels(), []
    manifest = manifest_for(module, tmp_path)
    manifest.path.mkdir(parents=True)  # a folder where the file should go
    assert warm_up_kernels(STEPS, full_warm_up(module, []), manifest, events.append) is False
    assert "was not written" in events[-1].message and "full warm-up again" in events[-1].message


def test_the_warm_ups_lookups_are_not_in_the_expert_statistics(tmp_path):
    """The warm-up's scratch prefill and decode steps look experts up; the statistics (hit rate,
    usage, `hottest` for /pin hot) start with the user's first prompt. What is resident stays."""
    from converter.convert import convert
    from engine.engine import Engine
    from engine.sampling import SamplingParams

    ckpt = synth.write_checkpoint(tmp_path / "ckpt", synth.tiny_config(vocab_size=129280), synth.SynthOptions(seed=0))
    out = convert(ckpt, tmp_path / "converted", resume=False)
    eng = Engine.load(out, EngineConfig(numerics="exact", cache_bytes=24 * 4096 * 64), warmup=False)
    try:
        experts = eng.files.experts
        assert eng.info["experts"] == "streaming" and experts.cache is not None
        eng.warm_up()
        c = experts.cache.stats()
        assert c.entries > 0  # the warm-up's experts stay resident
        assert (c.hits, c.misses, c.admissions, c.evictions, c.window_lookups) == (0, 0, 0, 0, 0)
        assert experts.hottest(3) == [] and sum(experts.usage.layer_uses) == 0 and not experts.usage.uses
        assert experts.usage.wait_s == 0.0 and eng.stats().cache.hit_rate == 0.0
        sess = eng.new_session()
        list(eng.generate(sess, "Hello", SamplingParams(temperature=0.0, max_tokens=3)))
        c = experts.cache.stats()
        assert c.hits + c.misses > 0 and sum(experts.usage.layer_uses) > 0 and len(experts.hottest(3)) == 3
    finally:
        eng.close()


def test_the_shape_key_ignores_what_only_adds_variants_of_the_same_shapes():
    args = ModelArgs.from_dict(synth.flash_config(43), "flash")
    config = EngineConfig(prefill_chunk=2048, max_seq_len=4096)
    base = dict(args=args, config=config, converted=True, arch=(9, 0), tilelang_version="0.1.15")
    same = [dict(args=dataclasses.replace(args, n_layers=4, compress_ratios=args.compress_ratios[:4])),
            dict(args=dataclasses.replace(args, n_routed_experts=24)),
            dict(config=dataclasses.replace(config, max_seq_len=65536, cache_bytes=1 << 30))]
    other = [dict(args=dataclasses.replace(args, dim=2048)), dict(arch=(12, 1)), dict(tilelang_version="0.1.16"),
             dict(config=dataclasses.replace(config, prefill_chunk=1024)), dict(converted=False)]
    key = shape_key(**base)
    assert all(shape_key(**{**base, **v}) == key for v in same)
    assert len({shape_key(**{**base, **v}) for v in other} | {key}) == len(other) + 1


def test_hints_are_the_calls_of_every_file_of_the_shape_once(tmp_path):
    module = fake_kernels()
    factories = kernel_factories([module])
    build_some(module)
    calls = built_calls(factories)
    write_manifest(tmp_path / "a.json", "key-a", calls[:3], shape="s1")
    write_manifest(tmp_path / "b.json", "key-b", calls[2:], shape="s1")  # overlaps a.json by one call
    write_manifest(tmp_path / "c.json", "key-c", [KernelCall("fake_kernels.gemv_kernel", (64, 64, (9, 0)))],
                   shape="s2")  # another shape
    body = json.loads((tmp_path / "b.json").read_text())
    body["kernels"] += [{"factory": "fake_kernels.gone_kernel", "args": [1]}, {"args": 3}, "junk",
                        {"factory": "fake_kernels.gemv_kernel", "args": [{"m": 1}, 2, [9, 0]]},
                        {"factory": "fake_kernels.gemv_kernel", "args": [1, 2, [9, 0], "bfloat16", 4]},  # an older
                        {"factory": "fake_kernels.gemv_kernel", "args": [1, 2], "kwargs": {"depth": 2}}]  # signature
    (tmp_path / "b.json").write_text(json.dumps(body))
    (tmp_path / "d.json").write_text("{not json")
    paths = [tmp_path / n for n in ("a.json", "b.json", "c.json", "d.json", "missing.json")]
    assert read_hints(paths, "s1", factories) == calls
    assert read_hints(paths, "s3", factories) == []


def test_a_first_warm_up_compiles_the_hints_in_parallel_first_and_skips_failing_ones(tmp_path):
    first = fake_kernels()
    build_some(first)
    hints = built_calls(kernel_factories([first])) + [KernelCall("fake_kernels.norm_kernel", (-1, 1e-6, True, ()))]
    hint_file = tmp_path / "hints.json"
    write_manifest(hint_file, "hints", hints, shape="flash")

    fresh, ran, events = fake_kernels(), [], []
    manifest = dataclasses.replace(manifest_for(fresh, tmp_path), shape="flash", hints=(hint_file,))
    assert warm_up_kernels(STEPS, full_warm_up(fresh, ran), manifest, events.append, hint_workers=3) is False
    assert ran == [True]
    pre = [e for e in events if e.phase == PRECOMPILING]
    assert [(e.done, e.total) for e in pre[:len(hints) + 1]] == [(d, len(hints)) for d in range(len(hints) + 1)]
    assert len([e for e in pre if "failed" in e.message]) == 1 and "no kernel for d=-1" in pre[-1].message
    assert events.index(pre[-1]) < min(events.index(e) for e in events if e.phase == COMPILING)
    builds = [entry for entry in fresh.LOG]
    assert {thread for *_, thread in builds} <= {f"kernel-replay-{i}" for i in range(3)}  # the hints built them all
    assert not [t for t in threading.enumerate() if t.name.startswith("kernel-replay-")]
    written = json.loads(manifest.path.read_text())
    assert written["shape"] == "flash" and len(written["kernels"]) == len(hints) - 1

    other, ran, events = fake_kernels(), [], []  # hints of another shape: the warm-up alone
    manifest = dataclasses.replace(manifest_for(other, tmp_path / "o"), shape="tiny", hints=(hint_file,))
    warm_up_kernels(STEPS, full_warm_up(other, ran), manifest, events.append)
    assert ran == [True] and not [e for e in events if e.phase == PRECOMPILING]


def test_the_shipped_hints_name_real_factories_with_arguments_they_take():
    """engine/kernel_hints/*.json (bench/kernel_hints.py): every entry a factory of the kernels
    package, its arguments bound by the factory's signature (stale hints would be skipped: this
    says when to record them again)."""
    import inspect

    from engine.kernel_manifest import HINTS_DIR
    from kernels.backend import kernel_modules

    factories = kernel_factories(kernel_modules())
    files = sorted(HINTS_DIR.glob("*.json"))
    assert files
    for path in files:
        body = json.loads(path.read_text())
        calls = read_hints([path], body["shape"], factories)
        assert body["format"] == 1 and len(calls) == len(body["kernels"]) > 0, path
        for call in calls:
            inspect.signature(factories[call.factory].__wrapped__).bind(*call.args, **dict(call.kwargs))
