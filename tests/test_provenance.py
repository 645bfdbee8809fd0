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
