"""rename= and cast= never change what is restored without an error (issue 44, items 6 and 7).

A rename whose result puts a leaf where another leaf's folder is, or two leaves at one key path, is
refused naming both; a cast checks every value against the target dtype's finite range, and NaN or
inf where the target has none, whatever the dtypes' maxima say, bool sources included.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import flax_ckpt as fc

# ------------------------------------------------------------------------------------------- rename

PQRS = {"p": {"q": np.array([1, 2])}, "r": np.array([7, 7]), "s": np.array([3])}


@pytest.mark.parametrize(
    "rename, leaf, folder",
    [
        ({"r": "p"}, "'r' (renamed to 'p')", "'p/q'"),
        ({"p/q": "r/q"}, "'r'", "'p/q' (renamed to 'r/q')"),
        ({"r": "s/"}, "'s'", "'r' (renamed to 's/')"),
    ],
)
def test_a_rename_that_puts_a_leaf_where_a_folder_is_is_refused_naming_both(tmp_path, rename, leaf, folder):
    fc.save(tmp_path / "ck", PQRS)
    with pytest.raises(fc.RenameCollisionError) as e:
        fc.restore(tmp_path / "ck", rename=rename, report=True)
    msg = str(e.value)
    assert f"{leaf} is a leaf where {folder} needs a folder" in msg, msg
    assert str(tmp_path / "ck") in msg and "Fix:" in msg


def test_a_rename_into_a_target_that_meets_a_folder_is_refused_too(tmp_path):
    fc.save(tmp_path / "ck", PQRS)
    target = {"p": np.zeros(2, np.int64), "s": np.zeros(1, np.int64)}
    with pytest.raises(fc.RenameCollisionError, match="'r' \\(renamed to 'p'\\) is a leaf where 'p/q'"):
        fc.restore(tmp_path / "ck", target, rename={"r": "p"}, unexpected="ignore")


def test_a_rename_that_moves_a_folder_whole_restores_everything_and_reports_it_truly(tmp_path):
    fc.save(tmp_path / "ck", PQRS)
    out, report = fc.restore(tmp_path / "ck", rename={"p/q": "p2/q", "r": "p/r"}, report=True)
    assert {k: sorted(v) if isinstance(v, dict) else v.tolist() for k, v in out.items()} == {
        "p": ["r"],
        "p2": ["q"],
        "s": [3],
    }
    assert sorted(report.restored) == ["p/r", "p2/q", "s"]


def test_a_rename_into_a_list_position_keeps_every_leaf(tmp_path):
    fc.save(tmp_path / "ck", {"a": [np.ones(1), np.zeros(1)], "b": np.full(1, 2.0)})
    out, report = fc.restore(tmp_path / "ck", rename={"a/1": "a/x"}, report=True)
    assert sorted(report.restored) == ["a/0", "a/x", "b"]
    a = out["a"]
    leaves = {str(k): v.tolist() for k, v in (a.items() if isinstance(a, dict) else enumerate(a))}
    assert leaves == {"0": [1.0], "x": [0.0]} and out["b"].tolist() == [2.0]


# --------------------------------------------------------------------------------------------- cast

F4, F6A, F6B = ml_dtypes.float4_e2m1fn, ml_dtypes.float6_e2m3fn, ml_dtypes.float6_e3m2fn
E4M3FN, E8M0 = ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e8m0fnu


def cast(tmp_path, values, dst):
    fc.save(tmp_path / "ck", {"w": values})
    return fc.restore(tmp_path / "ck", {"w": np.zeros(values.shape, dst)}, cast=True)["w"]


@pytest.mark.parametrize(
    "values, dst, found",
    [
        (
            np.array([1, 1000, -1e6], np.float32),
            F4,
            r"2 values .*\(e\.g\. 1000\.0 would become 6\.0\).*finite range \[-6, 6\]",
        ),
        (np.array([1, 8, 100], np.float32), F6A, r"2 values .*8\.0 would become 7\.5.*\[-7\.5, 7\.5\]"),
        (np.array([1, 29, 100], np.float32), F6B, r"1 values .*100\.0 would become 28\.0.*\[-28, 28\]"),
        (np.array([1, np.inf], np.float32), E4M3FN, r"1 values .*inf would become nan.*has no infinity"),
        (np.array([0, 1, -1], np.int32), E8M0, r"2 values .*0 would become nan"),
        (np.array([True, False]), E8M0, r"1 values .*False would become nan"),
        (np.array([np.nan, 1], np.float32), F4, r"1 values .*nan would become -?0\.0.*has no NaN"),
        (np.array([1, 7], np.int8), F4, r"1 values .*7 would become 6\.0"),  # a tie rounds past 6, to even
        (np.array([464, 465], np.float32), E4M3FN, r"1 values .*465\.0 would become nan"),
    ],
)
def test_a_cast_that_would_change_a_value_is_an_error_naming_it(tmp_path, values, dst, found):
    with pytest.raises(fc.CastOverflowError, match=found) as e:
        cast(tmp_path, values, dst)
    msg = str(e.value)
    assert f"restore of 'w': cast=True cannot convert {values.dtype.name} to {np.dtype(dst).name}" in msg
    assert "Fix:" in msg


@pytest.mark.parametrize(
    "values, dst",
    [
        (np.array([1, 6, -6, 0.25, 6.9], np.float32), F4),  # 6.9 rounds to 6, the largest
        (np.array([True, False]), F4),
        (np.array([0.5, 1, 2.0**100], np.float32), E8M0),
        (np.array([np.nan, 448, -448, 464], np.float32), E4M3FN),  # it has a NaN; 464 is a tie, to even: 448
        (np.array([np.nan, np.inf, -np.inf, 1], np.float32), ml_dtypes.bfloat16),
        (np.array([-3, 3], np.int8), F6A),
    ],
)
def test_a_cast_of_values_the_target_holds_is_numpy_astype(tmp_path, values, dst):
    out = cast(tmp_path, values, dst)
    assert out.dtype == np.dtype(dst) and out.tobytes() == values.astype(dst).tobytes()
