"""scikit-learn's own estimator checks over both estimators, with no expected failures (issue #32).

``parametrize_with_checks`` runs every check scikit-learn applies to its own estimators (clone,
pickling, input validation, fitted-state errors, dtypes, scores on small problems ...) as one test
each. Where a check needed a deliberate choice to pass, docs/sklearn.md says which and why.
"""

from __future__ import annotations

import pytest

pytest.importorskip("sklearn")

from sklearn.utils.estimator_checks import parametrize_with_checks  # noqa: E402

from mlptrain.sklearn import MLPClassifier, MLPRegressor  # noqa: E402


@pytest.mark.filterwarnings("ignore::sklearn.exceptions.ConvergenceWarning")
@parametrize_with_checks([MLPClassifier(), MLPRegressor()])
def test_sklearn_estimator_check(estimator, check) -> None:
    check(estimator)


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore::sklearn.exceptions.ConvergenceWarning")
@parametrize_with_checks([MLPClassifier(device="gpu"), MLPRegressor(device="gpu")])
def test_sklearn_estimator_check_on_the_gpu(estimator, check) -> None:
    """The same checks on the GPU (fused cuBLASLt epilogs, CUDA graphs): the lead runs them on the H200."""
    check(estimator)
