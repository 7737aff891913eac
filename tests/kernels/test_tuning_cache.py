"""The small-M kernel tuning cache: choices kept per GPU environment survive restarts, partial or foreign entries are
timed again, a broken file costs a re-tune (not a crash), and concurrent starts merge instead of overwriting."""

from __future__ import annotations

import json
import logging

import pytest

from workers.config import EngineConfig
from workers.kernels.small_m_linear import ROW_BUCKETS, TileConfig
from workers.kernels.tuning import TuningCache

ENV = "NVIDIA H100 80GB HBM3 | torch 2.11 | triton 3.6"
TABLE = {rows: (TileConfig(1, 16, 512, 4, 3) if rows == 1 else None if rows == 16 else
                TileConfig(16, 64, 256, 4, 4, weight_left=True) if rows == 4 else TileConfig(16, 32, 256, 4, 4))
         for rows in ROW_BUCKETS}


def test_choices_survive_a_restart_for_the_same_environment_only(tmp_path):
    path = tmp_path / "sub" / "small_m_linear.json"  # the directory is made on save
    cache = TuningCache(path, ENV)
    assert cache.get("4096x4096 bfloat16") is None
    cache.put("4096x4096 bfloat16", TABLE)
    assert cache.get("4096x4096 bfloat16") == TABLE  # readable before saving too
    cache.save()
    again = TuningCache(path, ENV)
    got = again.get("4096x4096 bfloat16")
    assert got == TABLE and isinstance(got[1], TileConfig) and got[16] is None and got[4].weight_left
    assert again.get("6144x4096 bfloat16") is None
    assert TuningCache(path, "NVIDIA A100 | torch 2.11 | triton 3.6").get("4096x4096 bfloat16") is None


def test_incomplete_or_foreign_entries_are_timed_again(tmp_path):
    path = tmp_path / "c.json"
    missing_bucket = {str(r): None for r in ROW_BUCKETS if r != 8}
    wrong_arity = {str(r): [16, 32] for r in ROW_BUCKETS}
    path.write_text(json.dumps({ENV: {"a": missing_bucket, "b": wrong_arity}}))
    cache = TuningCache(path, ENV)
    assert cache.get("a") is None and cache.get("b") is None


@pytest.mark.parametrize("content", ["{not json", "[1, 2]"])
def test_an_unreadable_file_is_retuned_and_replaced(tmp_path, caplog, content):
    path = tmp_path / "c.json"
    path.write_text(content)
    with caplog.at_level(logging.WARNING, logger="workers.kernels.tuning"):
        cache = TuningCache(path, ENV)
    assert cache.get("k") is None
    assert any("unreadable" in r.getMessage() for r in caplog.records)
    cache.put("k", TABLE)
    cache.save()
    assert TuningCache(path, ENV).get("k") == TABLE


def test_concurrent_starts_merge_their_entries(tmp_path):
    path = tmp_path / "c.json"
    first, second = TuningCache(path, ENV), TuningCache(path, ENV)  # both loaded before either saved
    first.put("a", TABLE)
    second.put("b", TABLE)
    first.save()
    second.save()
    cache = TuningCache(path, ENV)
    assert cache.get("a") == TABLE and cache.get("b") == TABLE
    assert [p.name for p in tmp_path.iterdir()] == ["c.json"]  # no temporary file left behind


def test_nothing_is_written_when_nothing_was_timed(tmp_path):
    path = tmp_path / "c.json"
    TuningCache(path, ENV).save()
    assert not path.exists()


def test_cache_directory_setting(tmp_path, monkeypatch):
    monkeypatch.delenv("SPECSERVE_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert EngineConfig(model="m").resolved_tuning_cache_dir() == str(tmp_path / "xdg" / "specserve")
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path / "env"))
    assert EngineConfig(model="m").resolved_tuning_cache_dir() == str(tmp_path / "env")
    assert EngineConfig(model="m", tuning_cache_dir=str(tmp_path / "x")).resolved_tuning_cache_dir() == str(
        tmp_path / "x")
    assert EngineConfig(model="m", tuning_cache_dir="").resolved_tuning_cache_dir() is None


def test_the_environment_names_the_candidates(monkeypatch):
    """A cache written while other tile configs were candidates (an older release) is timed again: the environment
    key carries a digest of the candidate set."""
    from workers.kernels import small_m_linear as sml
    from workers.kernels import tuning

    monkeypatch.setattr(sml.torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    before = tuning.tuning_environment("cuda")
    assert before.startswith("NVIDIA H100 80GB HBM3 | torch ") and f"candidates {tuning.candidates_digest()}" in before
    monkeypatch.setitem(sml.GEMV_CANDIDATES, 1, sml.GEMV_CANDIDATES[1][:-1])
    assert tuning.tuning_environment("cuda") != before
