"""The tables of ``benchmarks/bench_tables.py``: real ones scikit-learn and palmerpenguins ship, and generated ones with
what real tables hold (text categories, empty cells, an id column, a leakage column, rare classes).

Each :class:`Table` is a training and a test :class:`pandas.DataFrame` as they are written to CSV: raw cells,
text where the source has text, ``NaN`` (an empty cell) where a value is missing. It imports nothing of
mlptrain; scikit-learn, pandas and palmerpenguins are imported where a table is made (the dev extra).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
from sklearn.model_selection import train_test_split


@dataclass
class Table:
    """A table to train on: its rows split 75/25 (stratified by class), the target, the columns to leave out."""

    name: str
    train: pd.DataFrame
    test: pd.DataFrame
    target: str
    task: str = "classification"
    drop: list[str] = field(default_factory=list)
    imbalanced: bool = False  # 3-6% positives: scored by balanced accuracy against a class-weighted LR
    categorical: list[str] = field(default_factory=list)  # numeric codes that are categories (data.categorical)
    what: str = ""

    @property
    def rows(self) -> int:
        return len(self.train) + len(self.test)


def split(frame: pd.DataFrame, target: str, task: str, seed: int = 0) -> tuple[pd.DataFrame, pd.DataFrame]:
    stratify = frame[target] if task == "classification" else None
    train, test = train_test_split(frame, test_size=0.25, random_state=seed, stratify=stratify)
    return train.reset_index(drop=True), test.reset_index(drop=True)


def bundled(name: str, task: str, what: str) -> Table:
    """A table scikit-learn ships, its target column named ``target`` (diabetes unscaled: its raw units)."""
    import sklearn.datasets as sd

    loader = getattr(sd, f"load_{name}")
    kwargs = {"scaled": False} if name == "diabetes" else {}
    frame = loader(as_frame=True, **kwargs).frame
    return Table(name, *split(frame, "target", task), target="target", task=task, what=what)


def penguins() -> Table:
    """palmerpenguins: species from measurements, island and sex (text), 19 empty cells in 344 rows."""
    from palmerpenguins import load_penguins

    frame = load_penguins()
    what = "text: island, sex; empty cells in 5 columns"
    return Table("penguins", *split(frame, "species", "classification"), target="species", what=what)


def _with_empty(rng: np.random.Generator, values: np.ndarray, share: float) -> np.ndarray:
    out = values.astype(object) if values.dtype.kind in "OUS" else values.astype(float)
    out[rng.random(len(values)) < share] = np.nan
    return out


def customers(rows: int = 4000, seed: int = 1) -> Table:
    """Three text classes from mixed units (a skewed income, an age, a ratio of spread 1e-3), text categories with a
    rare level (and one the training rows never hold), empty cells, an id and a leakage column."""
    rng = np.random.default_rng(seed)
    age = rng.uniform(18, 80, rows)
    income = rng.lognormal(10.5, 0.8, rows)  # about 10,000 to 300,000, skewed
    tenure = rng.integers(0, 121, rows)
    regions = ["north", "south", "east", "west", "centre", "isles"]
    region = rng.choice(regions, rows, p=[0.3, 0.25, 0.2, 0.15, 0.09, 0.01])
    plan = rng.choice(["basic", "plus", "pro"], rows, p=[0.5, 0.3, 0.2])
    ratio = 0.5 + 1e-3 * rng.normal(size=rows)  # a small spread that carries signal
    effect = {"north": 0.0, "south": 0.6, "east": -0.5, "west": 0.3, "centre": -0.8, "isles": 1.5}
    plan_effect = {"basic": -0.7, "plus": 0.2, "pro": 0.9}
    z = (
        0.04 * (age - 45)
        + 0.9 * (np.log(income) - 10.5)
        + np.vectorize(effect.get)(region)
        + 800 * (ratio - 0.5)
        + 0.01 * (tenure - 60) * np.vectorize(plan_effect.get)(plan)
    )
    w = np.vectorize(plan_effect.get)(plan) - 0.02 * np.abs(age - 45)
    logits = np.stack([np.zeros(rows), z, w + 0.5 * np.sin(z)], axis=1) + rng.gumbel(size=(rows, 3))
    label = np.array(["stay", "leave", "upgrade"])[np.argmax(logits, axis=1)]
    code = np.where(rng.random(rows) < 0.97, np.char.add("C-", label), "C-other")  # leakage: the outcome's code
    frame = pd.DataFrame(
        {
            "customer_id": rng.permutation(rows) + 100000,
            "age": _with_empty(rng, np.round(age), 0.08),
            "income": _with_empty(rng, np.round(income, 2), 0.10),
            "tenure_months": tenure,
            "region": _with_empty(rng, region, 0.05),
            "plan": plan,
            "ratio": np.round(ratio, 6),
            "outcome_code": code,
            "label": label,
        }
    )
    train, test = split(frame, "label", "classification")
    test.loc[test.index[:12], "region"] = "atlantis"  # a level the training rows never hold
    what = "3 text classes; text: region (a 1% level, an unseen one), plan; 8-10% empty cells; id, leakage"
    return Table("customers", train, test, "label", drop=["customer_id", "outcome_code"], what=what)


def houses(rows: int = 3000, seed: int = 2) -> Table:
    """A price from area, rooms, age, a neighbourhood of 12 levels and a condition (text), empty cells, an id and a
    leakage column (the price per square metre)."""
    rng = np.random.default_rng(seed)
    area = rng.uniform(30, 300, rows)
    rooms = np.clip(np.round(area / 35 + rng.normal(0, 1, rows)), 1, 10)
    year = rng.integers(1900, 2025, rows)
    hoods = [f"hood_{i:02d}" for i in range(12)]
    p = np.r_[np.full(10, 0.098), 0.01, 0.01]
    hood = rng.choice(hoods, rows, p=p / p.sum())
    hood_price = dict(zip(hoods, rng.uniform(1500, 6000, 12), strict=True))
    condition = rng.choice(["poor", "fair", "good", "excellent"], rows, p=[0.1, 0.3, 0.4, 0.2])
    cond = {"poor": 0.8, "fair": 0.95, "good": 1.05, "excellent": 1.2}
    lot = rng.lognormal(6, 0.7, rows)
    per_m2 = np.vectorize(hood_price.get)(hood) * np.vectorize(cond.get)(condition) * (1 + (year - 1960) / 400)
    price = area * per_m2 + 40 * np.sqrt(lot) + 8000 * rooms + rng.normal(0, 40000, rows)
    frame = pd.DataFrame(
        {
            "house_id": np.arange(rows),
            "area_m2": np.round(area, 1),
            "rooms": rooms.astype(int),
            "year_built": year,
            "neighbourhood": hood,
            "condition": _with_empty(rng, condition, 0.05),
            "lot_m2": _with_empty(rng, np.round(lot, 1), 0.15),
            "price_per_m2": np.round(price / area * rng.normal(1, 0.02, rows), 1),  # leakage
            "price": np.round(price, -2),
        }
    )
    what = "text: neighbourhood (12 levels, 2 rare), condition; 5-15% empty cells; id, leakage"
    train, test = split(frame, "price", "regression")
    return Table("houses", train, test, "price", "regression", ["house_id", "price_per_m2"], what=what)


def fraud(rows: int = 6000, seed: int = 3) -> Table:
    """About 4% positives: a fraud flag from an amount (skewed), the hour, a merchant type and a country (text, rare
    levels), a device (text, empty cells), an account age (empty cells), an id and a leakage column."""
    rng = np.random.default_rng(seed)
    amount = rng.lognormal(3.5, 1.2, rows)
    hour = rng.integers(0, 24, rows)
    merchants = ["grocery", "fuel", "travel", "online", "electronics", "jewellery", "restaurant", "pharmacy"]
    merchant = rng.choice(merchants, rows)
    countries = [f"c{i:02d}" for i in range(20)]
    pc = np.r_[np.full(5, 0.15), np.full(15, 0.25 / 15)]
    country = rng.choice(countries, rows, p=pc / pc.sum())
    device = rng.choice(["ios", "android", "web", "pos"], rows)
    account_days = rng.exponential(600, rows)
    risk = {"travel": 1.0, "online": 1.2, "electronics": 1.4, "jewellery": 1.8}
    z = (
        -4.8
        + 0.8 * (np.log(amount) - 3.5)
        + np.where((hour < 5) | (hour > 22), 1.3, 0.0)
        + np.array([risk.get(m, 0.0) for m in merchant])
        + np.where(np.isin(country, countries[5:]), 1.0, 0.0)
        - 0.0015 * account_days
        + np.where(device == "web", 0.6, 0.0)
    )
    label = (rng.random(rows) < 1 / (1 + np.exp(-z))).astype(int)
    chargeback = np.where(rng.random(rows) < 0.95, label, 1 - label)  # leakage: known only afterwards
    frame = pd.DataFrame(
        {
            "transaction_id": [f"t{i:06d}" for i in rng.permutation(rows)],
            "amount": np.round(amount, 2),
            "hour": hour,
            "merchant": merchant,
            "country": country,
            "device": _with_empty(rng, device, 0.10),
            "account_age_days": _with_empty(rng, np.round(account_days), 0.08),
            "chargeback_filed": chargeback,
            "is_fraud": label,
        }
    )
    what = f"{label.mean():.1%} positives; text: merchant, country (15 rare levels), device; empty cells; id, leakage"
    train, test = split(frame, "is_fraud", "classification")
    drop = ["transaction_id", "chargeback_filed"]
    return Table("fraud", train, test, "is_fraud", drop=drop, imbalanced=True, what=what)


def churn(rows: int = 5000, seed: int = 4) -> Table:
    """About 5% positives ("yes"/"no" text): churn from a contract and a payment method (text), charges, support calls,
    empty cells, an id column."""
    rng = np.random.default_rng(seed)
    contract = rng.choice(["monthly", "yearly", "two_year"], rows, p=[0.5, 0.3, 0.2])
    payment = rng.choice(["card", "bank", "cheque", "voucher"], rows, p=[0.4, 0.35, 0.2, 0.05])
    charges = rng.uniform(15, 120, rows)
    calls = rng.poisson(1.2, rows)
    tenure = rng.integers(1, 72, rows)
    z = (
        -4.3
        + np.where(contract == "monthly", 1.4, np.where(contract == "yearly", 0.0, -1.2))
        + np.where(payment == "cheque", 0.7, 0.0)
        + 0.02 * (charges - 60)
        + 0.55 * calls
        - 0.03 * tenure
    )
    label = np.where(rng.random(rows) < 1 / (1 + np.exp(-z)), "yes", "no")
    frame = pd.DataFrame(
        {
            "account": [f"AC-{i}" for i in range(rows)],
            "contract": contract,
            "payment": _with_empty(rng, payment, 0.06),
            "monthly_charges": _with_empty(rng, np.round(charges, 2), 0.05),
            "support_calls": calls,
            "tenure_months": tenure,
            "churned": label,
        }
    )
    what = f"{(label == 'yes').mean():.1%} positives (text labels); text: contract, payment; empty cells; id"
    return Table(
        "churn", *split(frame, "churned", "classification"), "churned", drop=["account"], imbalanced=True, what=what
    )


def _long_tail(rng: np.random.Generator, levels: int, rows: int, a: float) -> np.ndarray:
    """``(rows,)`` level ids drawn with Zipf frequencies ``1 / rank^a`` (ranks shuffled): a few common levels and a
    long tail of rare ones, as product ids and zip codes have."""
    p = 1.0 / np.arange(1, levels + 1) ** a
    return rng.permutation(levels)[rng.choice(levels, rows, p=p / p.sum())]


def products(rows: int = 10000, seed: int = 5) -> Table:
    """Bought or not from a product id of 1,000 levels (Zipf frequencies: half the levels seen under 5 times), each
    product's appeal and price sensitivity its category's (25 levels, a column too) plus its own; price, discount."""
    rng = np.random.default_rng(seed)
    category_of = rng.integers(0, 25, 1000)  # each product's category
    appeal = rng.normal(0, 1.0, 25)[category_of] + rng.normal(0, 0.8, 1000)
    sensitivity = np.abs(rng.normal(1.0, 0.4, 25))[category_of] * np.exp(rng.normal(0, 0.3, 1000))
    product = _long_tail(rng, 1000, rows, 1.0)
    price = rng.lognormal(3.0, 0.6, rows)
    discount = rng.uniform(0, 0.5, rows)
    z = appeal[product] - sensitivity[product] * (np.log(price) - 3.0) * 1.5 + 2.0 * discount - 0.3
    label = np.where(rng.random(rows) < 1 / (1 + np.exp(-z)), "yes", "no")
    frame = pd.DataFrame(
        {
            "product_id": [f"P{p:04d}" for p in product],
            "category": [f"cat{c:02d}" for c in category_of[product]],
            "price": np.round(price, 2),
            "discount": np.round(discount, 3),
            "bought": label,
        }
    )
    what = "text: product_id (1,000 levels, Zipf), category (25 levels); the id carries appeal and price sensitivity"
    return Table("products", *split(frame, "bought", "classification"), "bought", what=what)


def zipcodes(rows: int = 8000, seed: int = 6) -> Table:
    """A price from the area and a zip code of 800 levels (Zipf frequencies), each zip's price per square metre its
    region's (10 levels, a column too) times its own; rooms, a condition (text)."""
    rng = np.random.default_rng(seed)
    region_of = rng.integers(0, 10, 800)
    per_m2 = rng.uniform(1500, 6000, 10)[region_of] * np.exp(rng.normal(0, 0.3, 800))
    zipc = _long_tail(rng, 800, rows, 0.9)
    area = rng.uniform(30, 250, rows)
    rooms = np.clip(np.round(area / 35 + rng.normal(0, 1, rows)), 1, 9)
    condition = rng.choice(["poor", "fair", "good", "excellent"], rows, p=[0.1, 0.3, 0.4, 0.2])
    cond = np.vectorize({"poor": 0.8, "fair": 0.95, "good": 1.05, "excellent": 1.2}.get)(condition)
    price = area * per_m2[zipc] * cond + 6000 * rooms + rng.normal(0, 30000, rows)
    frame = pd.DataFrame(
        {
            "zip": [int(f"{region_of[z] + 1}{z:04d}") for z in zipc],  # numbers, as zip codes are
            "region": [f"r{r}" for r in region_of[zipc]],
            "area_m2": np.round(area, 1),
            "rooms": rooms.astype(int),
            "condition": condition,
            "price": np.round(price, -2),
        }
    )
    what = "zip (800 levels, Zipf, 5-digit codes: data.categorical), region (10), condition; the zip sets the price/m2"
    train, test = split(frame, "price", "regression")
    return Table("zipcodes", train, test, "price", "regression", what=what, categorical=["zip"])


def agents(seed: int = 7) -> Table:
    """``customers`` with one more text column, an ``agent`` of 600 levels (Zipf frequencies) that has no effect on
    the label: a column of many levels that a model should learn to ignore."""
    t = customers()
    rng = np.random.default_rng(seed)
    for frame in (t.train, t.test):
        frame.insert(1, "agent", [f"A{a:03d}" for a in _long_tail(rng, 600, len(frame), 1.0)])
    return Table("agents", t.train, t.test, t.target, drop=t.drop, what=f"{t.what}; agent: 600 levels, no effect")


# Tables with a categorical column of hundreds of levels (benchmarks/bench_embeddings.py); not in TABLES: their
# columns have more levels than HistGradientBoosting's categorical support (255)
MANY_LEVELS: dict[str, Callable[[], Table]] = {"products": products, "zipcodes": zipcodes, "agents": agents}

TABLES: dict[str, Callable[[], Table]] = {
    "iris": lambda: bundled("iris", "classification", "4 numeric columns, 3 classes"),
    "wine": lambda: bundled("wine", "classification", "13 numeric columns in mixed units, 3 classes"),
    "breast_cancer": lambda: bundled("breast_cancer", "classification", "30 numeric columns in mixed units"),
    "digits": lambda: bundled("digits", "classification", "64 pixel columns, 10 classes"),
    "penguins": penguins,
    "customers": customers,
    "diabetes": lambda: bundled("diabetes", "regression", "10 numeric columns; a whole-number target"),
    "houses": houses,
    "fraud": fraud,
    "churn": churn,
}
