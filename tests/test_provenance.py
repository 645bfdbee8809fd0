import json

import pandas as pd
import pytest

from kvbench.provenance import PROVENANCE_COLUMNS, config_hash, provenance, write_table


def test_config_hash_is_stable_and_sensitive():
    a = {"seed": 1, "corpus": {"x": [1, 2]}}
    assert config_hash(a) == config_hash({"corpus": {"x": [1, 2]}, "seed": 1})
    assert config_hash(a) != config_hash({"seed": 2, "corpus": {"x": [1, 2]}})


def test_every_row_carries_provenance(tmp_path):
    prov = provenance({"seed": 5, "hf_offline": True}, model="m")
    assert set(prov) == set(PROVENANCE_COLUMNS)
    versions = json.loads(prov["package_versions"])
    assert "torch" in versions and "pandas" in versions
    out = tmp_path / "sub" / "t.parquet"
    write_table(pd.DataFrame({"a": [1, 2, 3]}), out, prov)
    back = pd.read_parquet(out)
    assert len(back) == 3
    for col in PROVENANCE_COLUMNS:
        assert back[col].nunique() == 1 and back[col].iloc[0] == prov[col]
    assert [p.name for p in out.parent.iterdir()] == ["t.parquet"]  # no temporary left behind


def test_empty_table_keeps_provenance_columns(tmp_path):
    out = tmp_path / "empty.parquet"
    write_table(pd.DataFrame({"a": pd.Series([], dtype=int)}), out, provenance({"seed": 1}, model="m"))
    assert set(PROVENANCE_COLUMNS) <= set(pd.read_parquet(out).columns)


def test_failed_write_leaves_previous_output_intact(tmp_path):
    out = tmp_path / "t.parquet"
    prov = provenance({"seed": 1}, model="m")
    write_table(pd.DataFrame({"a": [1]}), out, prov)
    with pytest.raises(ValueError):
        write_table(pd.DataFrame({"model": [1]}), out, prov)  # clashes with a provenance column
    assert pd.read_parquet(out)["a"].tolist() == [1]
    assert [p.name for p in tmp_path.iterdir()] == ["t.parquet"]


def test_read_tables_concatenates_and_strips_provenance(tmp_path):
    from kvbench.provenance import read_tables

    prov = provenance({"seed": 1}, model="m")
    write_table(pd.DataFrame({"a": [1, 2]}), tmp_path / "x.parquet", prov)
    write_table(pd.DataFrame({"a": [3]}), tmp_path / "y.parquet", prov)
    merged = read_tables([str(tmp_path / "x.parquet"), str(tmp_path / "y.parquet")])
    assert list(merged.columns) == ["a"] and merged.a.tolist() == [1, 2, 3]


def test_hardware_names_cpu_cores_features_memory_and_gpu():
    import os
    import re

    from kvbench.provenance import hardware

    desc = hardware()
    assert f"{os.cpu_count()} cores" in desc
    assert re.search(r"(avx2|avx512f|amx_tile|no AVX2/AVX-512/AMX)", desc)
    assert re.search(r"\d+\.\d GiB RAM", desc)
    machine = desc.split(", CPU decode kernels: ")[0]
    assert machine.endswith("GPU") or "x " in machine.split(", ")[-1]


def test_hardware_names_the_decode_kernels_where_methods_ran():
    import subprocess
    import sys

    script = (
        "import re, torch\n"
        "from kvbench.provenance import hardware\n"
        "assert 'kernels' not in hardware()\n"  # a stage that runs no method
        "from kvbench.methods.packing import lut_dots, pack\n"
        "assert re.search(r'CPU decode kernels: (native AVX|torch).*; no kernel calls$', hardware()), hardware()\n"
        "packed = pack(torch.zeros(2, 8, 64, dtype=torch.int64), 2).view(2, 8, -1)\n"
        "native = lut_dots(packed, 2, (0.0, 1.0, 2.0, 3.0), torch.ones(2, 1, 64)) is not None\n"
        "lut_dots(packed.to('meta'), 2, (0.0, 1.0, 2.0, 3.0), torch.ones(2, 1, 64))\n"
        "ran = '1 native, ' if native else ''\n"
        "assert hardware().endswith(f'; kernel calls: {ran}1 torch (not on the CPU)') or not native, hardware()\n"
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]


@pytest.mark.parametrize("mask, file_mode, dir_mode", [(0o022, 0o644, 0o755), (0o002, 0o664, 0o775)])
def test_outputs_are_readable_by_the_group(tmp_path, mask, file_mode, dir_mode):
    import os
    import stat

    from kvbench.atomic import atomic_path

    old = os.umask(mask)
    try:
        write_table(pd.DataFrame({"a": [1]}), tmp_path / "t.parquet", provenance({"seed": 1}, model="m"))
        with atomic_path(tmp_path / "model", is_dir=True) as tmp:
            (tmp / "config.json").write_text("{}")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "t.parquet").stat().st_mode) == file_mode
    assert stat.S_IMODE((tmp_path / "model").stat().st_mode) == dir_mode
    assert stat.S_IMODE((tmp_path / "model" / "config.json").stat().st_mode) == file_mode


def test_a_summary_over_several_models_keeps_each_rows_model(tmp_path):
    from kvbench.provenance import read_tables

    for model in ("llama", "mistral"):
        write_table(
            pd.DataFrame({"method": ["full"]}), tmp_path / f"{model}.parquet", provenance({"seed": 1}, model=model)
        )
    merged = read_tables([str(tmp_path / "llama.parquet"), str(tmp_path / "mistral.parquet")], keep=("model",))
    write_table(merged, tmp_path / "all.parquet", provenance({"seed": 1}, model=None))
    back = pd.read_parquet(tmp_path / "all.parquet")
    assert back.model.tolist() == ["llama", "mistral"] and set(PROVENANCE_COLUMNS) <= set(back.columns)
    with pytest.raises(ValueError, match="neither given nor in the table"):
        write_table(pd.DataFrame({"a": [1]}), tmp_path / "x.parquet", provenance({"seed": 1}, model=None))
