"""scikit-learn estimators on mlptrain: ``MLPClassifier`` and ``MLPRegressor`` (``pip install -e '.[sklearn]'``).

::

    from mlptrain.sklearn import MLPClassifier
    clf = MLPClassifier(hidden_layer_sizes=(128, 128)).fit(X, y)   # raw rows: normalised as the CLI does
    clf.predict(X)

================= ==================================================================
module            what it owns
================= ==================================================================
``estimators``    the two estimators: checks of ``X`` and ``y``, ``fit``, ``predict``
``params``        scikit-learn's parameter names, checked and turned into a ``TrainConfig``
``fitting``       the CLI's split and normalisation, epochs of the CLI's ``Trainer``, the stopping rule
``persist``       the fitted state as an mlptrain checkpoint: ``save``, ``load``, the ``Predictor``
``frames``        a DataFrame with text, ``category`` or empty cells, through the CLI's column plan
``crossval``      ``cross_val_predict``, ``cross_validate``: scikit-learn's calls, the folds one batched run
``foldshape``     a fold of fewer encoded columns or classes than the others, widened for the run, cut back after
``sample_weight`` ``fit(X, y, sample_weight=)``: checked as scikit-learn does, in the CLI's row-weighted loss
================= ==================================================================

docs/sklearn.md says what matches scikit-learn's own MLP and what does not.
"""

from mlptrain.sklearn.crossval import cross_val_predict, cross_validate
from mlptrain.sklearn.estimators import MLPClassifier, MLPRegressor

__all__ = ["MLPClassifier", "MLPRegressor", "cross_val_predict", "cross_validate"]
