"""The mapping-count preflight of long CPU runs (etjax/host_limits.py)."""

from __future__ import annotations

from etjax.host_limits import (
    RECOMMENDED_MAP_COUNT,
    current_map_count,
    map_count_limit,
    map_count_warning,
)


def test_map_count_limit_reads_the_kernel_file_or_gives_none(tmp_path):
    limit = tmp_path / "max_map_count"
    limit.write_text("65530\n")
    assert map_count_limit(limit) == 65530
    limit.write_text("not a number")
    assert map_count_limit(limit) is None
    assert map_count_limit(tmp_path / "missing") is None


def test_only_a_cpu_run_below_the_need_is_warned():
    message = map_count_warning("cpu", 65530, RECOMMENDED_MAP_COUNT)
    assert "vm.max_map_count is 65530" in message
    assert "sysctl -w vm.max_map_count=" in message
    assert map_count_warning("cpu", RECOMMENDED_MAP_COUNT, RECOMMENDED_MAP_COUNT) is None
    assert map_count_warning("gpu", 65530, RECOMMENDED_MAP_COUNT) is None
    assert map_count_warning("cpu", None, RECOMMENDED_MAP_COUNT) is None


def test_current_map_count_counts_lines_of_the_maps_file(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text("a\nb\nc\n")
    assert current_map_count(maps) == 3
    assert current_map_count(tmp_path / "missing") == 0
    assert current_map_count() > 0  # this process, on Linux
