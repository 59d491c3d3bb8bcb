"""The estimators on pandas DataFrames with text, ``category``, integer-coded and empty cells (#49): the CLI's
column plan (mlptrain.sklearn.frames), its encoding against scikit-learn's ColumnTransformer column for column,
columns matched by name, unseen levels, and the plan through pickle, save/load and the Predictor."""

from __future__ import annotations

import math
import pickle
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from numpy.testing import assert_allclose, assert_array_equal

pd = pytest.importorskip("pandas")
from sklearn.base import clone  # noqa: E402
from sklearn.compose import ColumnTransformer  # noqa: E402
from sklearn.exceptions import ConvergenceWarning  # noqa: E402
from sklearn.impute import SimpleImputer  # noqa: E402
from sklearn.preprocessing import OneHotEncoder  # noqa: E402

from mlptrain.data.prepare import stratified_split  # noqa: E402
from mlptrain.inference.predictor import predict  # noqa: E402
from mlptrain.sklearn import MLPClassifier, MLPRegressor  # noqa: E402
from mlptrain.sklearn.fitting import SPLIT_STREAM  # noqa: E402
from mlptrain.sklearn.frames import predict_input  # noqa: E402

NUMERIC = ["age", "income"]
CATEGORICAL = ["city", "size", "code"]


def table(n: int, seed: int = 0) -> tuple[Any, np.ndarray]:
    """A frame of every kind: a numeric column with empty cells, a complete one, a text column with None and
    NaN, a ``category`` column with an empty cell, an integer-coded column; a label decided by the categories."""
    rng = np.random.default_rng(seed)
    age = rng.normal(40, 10, n)
    age[rng.random(n) < 0.15] = np.nan
    city = rng.choice(np.array(["paris", "rome", "oslo", None], dtype=object), n, p=[0.35, 0.3, 0.25, 0.1])
    city[rng.random(n) < 0.05] = np.nan  # None and NaN: both empty
    size = pd.Categorical(rng.choice(["S", "M", "L"], n), categories=["S", "M", "L", "XL"])
    size[3] = np.nan
    frame = pd.DataFrame(
        {"age": age, "city": city, "size": size, "income": rng.lognormal(10, 1, n), "code": rng.integers(1, 4, n)}
    )
    label = (np.isin(city, ["rome", "oslo"]) ^ (frame["code"].to_numpy() == 2)) | (frame["size"] == "L").to_numpy()
    return frame, np.where(label, "yes", "no")


def fitted(frame: Any, y: np.ndarray, cls: Any = MLPClassifier, **kw: Any) -> Any:
    params = dict(hidden_layer_sizes=(32,), max_iter=40, learning_rate_init=0.01, random_state=0, device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        return cls(**{**params, "categorical_features": ["code"], **kw}).fit(frame, y)


def reference(frame: Any, train: Any) -> tuple[np.ndarray, list[str]]:
    """scikit-learn's usual front of an MLP, before the scaling: the median and its indicator, one-hot columns;
    the output columns named as the column plan names them."""
    ct = ColumnTransformer(
        [
            ("num", SimpleImputer(strategy="median", add_indicator=True), NUMERIC),
            ("cat", OneHotEncoder(handle_unknown="ignore", sparse_output=False), CATEGORICAL),
        ]
    ).fit(train)
    names = []
    for out in ct.get_feature_names_out():
        kind, name = out.split("__", 1)
        names.append(name.replace("missingindicator_", "") + "_missing" if "missingindicator_" in name else name)
    cat_names = [
        f"{c}={'<empty>' if v is None or (isinstance(v, float) and math.isnan(v)) else v}"
        for c, levels in zip(CATEGORICAL, ct.named_transformers_["cat"].categories_, strict=True)
        for v in levels
    ]
    return ct.transform(frame), names[: -len(cat_names)] + cat_names


def test_a_frame_of_text_category_integer_coded_and_empty_cells_fits_and_predicts() -> None:
    frame, y = table(400)
    clf = fitted(frame, y, max_iter=80)
    plan = clf.column_plan_
    kinds = {c.name: (c.kind, c.indicator) for c in plan.columns}
    assert kinds == {
        "age": ("numeric", True),
        "city": ("categorical", False),
        "size": ("categorical", False),
        "income": ("numeric", False),
        "code": ("categorical", False),  # integer codes, named by categorical_features
    }
    assert plan.columns[2].levels == ["<empty>", "L", "M", "S"]  # seen levels only: XL never occurs
    assert list(clf.feature_names_in_) == list(frame.columns) and clf.n_features_in_ == 5
    assert clf.state_.meta["data"]["feature_names"] == plan.feature_names  # the encoded inputs, as the CLI's
    assert clf.score(frame, y) > 0.95  # the label is a function of the categories: learnt, not guessed
    assert set(clf.predict(frame.head(7))) <= {"yes", "no"}
    reg = fitted(frame, np.where(y == "yes", 3.0, -1.0) + frame["income"].to_numpy() / 1e5, MLPRegressor)
    assert reg.predict(frame).shape == (400,) and reg.column_plan_.feature_names == plan.feature_names


def test_the_encoded_rows_are_column_transformers_column_for_column() -> None:
    """Training rows and new ones (an unseen category, an empty cell where training had none, an unseen text
    level) encode as ColumnTransformer(SimpleImputer(median, add_indicator), OneHotEncoder(ignore)) does."""
    frame, y = table(300)
    clf = fitted(frame, y, max_iter=2)
    want, names = reference(frame, frame)
    order = [names.index(n) for n in clf.column_plan_.feature_names]
    assert sorted(order) == list(range(len(names)))  # the same columns, no more, no fewer
    assert_allclose(predict_input(clf, frame, clf.column_plan_), want[:, order], rtol=0, atol=0)
    shift = clf.state_.arrays["data/shift"]  # standardised from these very columns (no validation split)
    binary = clf.column_plan_.binary()  # the one-hot and _missing columns stay 0/1: shift 0
    assert 0 < binary.sum() < len(binary)
    assert_allclose(shift, np.where(binary, 0.0, want[:, order].mean(axis=0)), rtol=1e-12)
    new, _ = table(40, seed=5)
    new["size"] = new["size"].cat.add_categories(["XXL"])
    new.loc[0, "size"], new.loc[1, "income"], new.loc[2, "city"], new.loc[3, "code"] = "XXL", np.nan, "lima", 9
    got = predict_input(clf, new, clf.column_plan_)
    assert_allclose(got, reference(new, frame)[0][:, order], rtol=0, atol=0)
    assert not got[0, [i for i, n in enumerate(clf.column_plan_.feature_names) if n.startswith("size=")]].any()


def test_columns_are_matched_by_name_a_missing_one_is_one_error_an_extra_one_scikit_learns() -> None:
    frame, y = table(200)
    clf = fitted(frame, y, max_iter=3)
    shuffled = frame[["code", "income", "size", "age", "city"]]
    assert_array_equal(clf.predict_proba(shuffled), clf.predict_proba(frame))
    with pytest.warns(UserWarning, match="X does not have valid feature names"):  # scikit-learn's warning
        assert_array_equal(clf.predict(frame.to_numpy(dtype=object)), clf.predict(frame))  # an array: fit's order
    with pytest.raises(ValueError, match=r"X lacks the column\(s\) \['size'\] that MLPClassifier was fitted with"):
        clf.predict(frame.drop(columns="size"))
    with pytest.raises(ValueError, match="Feature names unseen at fit time:\n- extra"):
        clf.predict(frame.assign(extra=1.0))
    with pytest.raises(ValueError, match="'lots' is not a number"):  # numeric in training, text now
        clf.predict(frame.assign(income=["lots"] * len(frame)))


def test_the_plan_survives_pickle_save_load_and_the_predictor(tmp_path: Path) -> None:
    frame, y = table(200)
    clf = fitted(frame, y, max_iter=3)
    again = pickle.loads(pickle.dumps(clf))
    assert again.column_plan_ == clf.column_plan_
    assert_array_equal(again.predict_proba(frame), clf.predict_proba(frame))
    loaded = MLPClassifier.load(clf.save(tmp_path / "m.npz"))
    assert loaded.column_plan_ == clf.column_plan_ and list(loaded.feature_names_in_) == list(frame.columns)
    assert loaded.get_params() == clf.get_params() == clone(clf).get_params()
    assert_array_equal(loaded.predict_proba(frame), clf.predict_proba(frame))
    # the CLI's Predictor reads the same plan from the saved file and scores the raw frame alike (in fp32)
    assert_allclose(
        predict(tmp_path / "m.npz", frame, probabilities=True, device="cpu"), clf.predict_proba(frame), atol=1e-5
    )


def test_numeric_input_keeps_scikit_learns_path_and_a_continued_fit_keeps_the_plan() -> None:
    frame, y = table(200)
    numeric = frame[["income"]].assign(age=frame["age"].fillna(40.0))
    assert fitted(numeric, y, max_iter=2, categorical_features="from_dtype").column_plan_ is None
    assert fitted(numeric.to_numpy(), y, max_iter=2).column_plan_ is None
    with pytest.raises(ValueError, match="Input X contains NaN"):  # no plan: NaN refused as before
        fitted(frame[["age"]].to_numpy(), y, max_iter=2)
    clf = fitted(frame, y, max_iter=2, warm_start=True)
    plan = clf.column_plan_
    more, _ = table(200, seed=3)
    more.loc[0, "city"] = "lima"  # a level the plan does not know: all zeros, the plan unchanged
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        clf.fit(more[list(reversed(more.columns))], y)
    assert clf.column_plan_ == plan and clf.n_iter_ == 4
    with pytest.raises(ValueError, match="categorical_features='size'"):
        fitted(frame, y, categorical_features="size")
    with pytest.raises(ValueError, match=r"categorical_features=\['nope'\]: 'nope' is not a column"):
        fitted(frame, y, categorical_features=["nope"])
    with pytest.raises(ValueError, match="min_frequency=0"):
        fitted(frame, y, min_frequency=0)


def test_with_early_stopping_the_plan_comes_from_the_train_split_alone() -> None:
    """The medians and levels are the train split's (the CLI's split: the same generator), never the held-out
    rows': a level only in the validation rows is unknown to the plan."""
    frame, y = table(300)
    clf = MLPClassifier(hidden_layer_sizes=(8,), max_iter=2, random_state=4, device="cpu", early_stopping=True)
    classes = np.searchsorted(np.unique(y), y)
    train, val = stratified_split(classes, 0.3, np.random.default_rng([4, SPLIT_STREAM]))
    frame.loc[val[0], "city"] = "lima"  # held out: not a level of the plan
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        plan = clf.set_params(validation_fraction=0.3).fit(frame, y).column_plan_
    assert plan.columns[0].fill == np.nanmedian(frame["age"].to_numpy()[train])
    assert plan.columns[0].fill != np.nanmedian(frame["age"].to_numpy())
    assert "lima" not in plan.columns[1].levels and len(clf.validation_scores_) == 2
