"""The standard normal's quantile function (``scipy.special.ndtri``, ``scipy.stats.norm.ppf``) in NumPy alone.

``data.normalize=quantile`` maps each feature through its training quantiles to a standard normal
(:mod:`mlptrain.data.files.column_stats`), and the predictor does the same to raw rows, so the inverse of
the normal CDF is needed wherever mlptrain scores, without SciPy (not a dependency). This is Wichura's
algorithm AS241 (PPND16, 1988), the one Python's ``statistics.NormalDist.inv_cdf`` implements: three
rational approximations of degree 7, relative error about 1e-16 over ``(0, 1)``:

* ``|p - 0.5| <= 0.425``: a rational function of ``r = 0.180625 - (p - 0.5)**2``, times ``p - 0.5``;
* else with ``r = sqrt(-log(min(p, 1 - p)))``: one of ``r - 1.6`` (``r <= 5``) or of ``r - 5`` (the far tails),
  its sign that of ``p - 0.5``.

``ndtri(0) = -inf``, ``ndtri(1) = +inf``, NaN outside ``[0, 1]``, as SciPy's.
"""

from __future__ import annotations

import numpy as np

# Coefficients of AS241, highest degree first (np.polyval's order): numerator and denominator of each region
# (public: mlptrain.inference.onnx_quantile builds the same function as ONNX nodes).
CENTRAL = (
    (
        2509.0809287301226727,
        33430.575583588128105,
        67265.770927008700853,
        45921.953931549871457,
        13731.693765509461125,
        1971.5909503065514427,
        133.14166789178437745,
        3.387132872796366608,
    ),
    (
        5226.495278852854561,
        28729.085735721942674,
        39307.89580009271061,
        21213.794301586595867,
        5394.1960214247511077,
        687.1870074920579083,
        42.313330701600911252,
        1.0,
    ),
)
NEAR = (
    (
        7.7454501427834140764e-4,
        0.0227238449892691845833,
        0.24178072517745061177,
        1.27045825245236838258,
        3.64784832476320460504,
        5.7694972214606914055,
        4.6303378461565452959,
        1.42343711074968357734,
    ),
    (
        1.05075007164441684324e-9,
        5.475938084995344946e-4,
        0.0151986665636164571966,
        0.14810397642748007459,
        0.68976733498510000455,
        1.6763848301838038494,
        2.05319162663775882187,
        1.0,
    ),
)
FAR = (
    (
        2.01033439929228813265e-7,
        2.71155556874348757815e-5,
        0.0012426609473880784386,
        0.026532189526576123093,
        0.29656057182850489123,
        1.7848265399172913358,
        5.4637849111641143699,
        6.6579046435011037772,
    ),
    (
        2.04426310338993978564e-15,
        1.4215117583164458887e-7,
        1.8463183175100546818e-5,
        7.868691311456132591e-4,
        0.0148753612908506148525,
        0.13692988092273580531,
        0.59983220655588793769,
        1.0,
    ),
)


def ndtri(p: np.ndarray) -> np.ndarray:
    """``x`` with ``Phi(x) = p`` for ``p`` of any shape, float64 (the standard normal's quantile function).

    Each region's rational function is evaluated on its own values only (boolean selections), Horner's rule in place.
    """
    p = np.asarray(p, dtype=np.float64)
    q = p - 0.5
    out = np.empty_like(p)
    central = np.abs(q) <= 0.425
    qc = q[central]
    r = 0.180625 - qc * qc
    out[central] = qc * _rational(CENTRAL, r)
    tail = ~central
    qt = q[tail]
    with np.errstate(divide="ignore", invalid="ignore"):  # p = 0 or 1: log(0) = -inf, r = inf; outside [0, 1]: NaN
        r = np.sqrt(-np.log(np.where(qt <= 0.0, p[tail], 1.0 - p[tail])))
        x = np.full_like(r, np.nan)
        near, far = r <= 5.0, r > 5.0
        x[near] = _rational(NEAR, r[near] - 1.6)
        x[far] = _rational(FAR, r[far] - 5.0)
    x[np.isinf(r)] = np.inf  # the tails' limits: p = 0 -> -inf, p = 1 -> +inf
    out[tail] = np.where(qt < 0.0, -x, x)
    return out


def _rational(coefficients: tuple[tuple[float, ...], tuple[float, ...]], t: np.ndarray) -> np.ndarray:
    """``num(t) / den(t)`` of one region's polynomials (highest degree first), by Horner's rule in place."""
    num, den = np.full_like(t, coefficients[0][0]), np.full_like(t, coefficients[1][0])
    for a, b in zip(coefficients[0][1:], coefficients[1][1:], strict=True):
        num *= t
        num += a
        den *= t
        den += b
    return num / den
