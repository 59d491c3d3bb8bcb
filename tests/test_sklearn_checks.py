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


@parametrize_with_checks([MLPClassifier(), MLPRegressor()])
def test_sklearn_estimator_check(estimator, check) -> None:
    check(estimator)
