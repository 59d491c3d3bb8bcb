"""05: mlptrain as a scikit-learn estimator: a Pipeline, cross-validation, and a saved model.

``mlptrain.sklearn.MLPClassifier`` takes scikit-learn's ``MLPClassifier`` parameters
(``hidden_layer_sizes``, ``solver``, ``alpha``, ``max_iter``, ``early_stopping`` ...) and trains with
mlptrain's fused step (the GPU when there is one), so it drops into ``Pipeline``, ``cross_val_score``
and ``GridSearchCV``. Needs the ``sklearn`` extra (``pip install -e '.[sklearn]'``).

    python examples/05_sklearn_estimator.py
"""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path

import numpy as np
from sklearn.datasets import load_breast_cancer
from sklearn.exceptions import ConvergenceWarning
from sklearn.model_selection import cross_val_score, train_test_split
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from mlptrain.sklearn import MLPClassifier

warnings.simplefilter("ignore", ConvergenceWarning)  # max_iter is kept small so the example is quick
X, y = load_breast_cancer(return_X_y=True)  # (569, 30) float64, 2 classes
X_train, X_test, y_train, y_test = train_test_split(X, y, test_size=0.25, stratify=y, random_state=0)

# A pipeline as with scikit-learn's own MLP: scale the features, then the network.
model = make_pipeline(StandardScaler(), MLPClassifier(hidden_layer_sizes=(64, 64), max_iter=60, random_state=0))
scores = cross_val_score(model, X_train, y_train, cv=5)  # five fits, each a run of mlptrain's step
print(f"5-fold accuracy {scores.mean():.3f} +- {scores.std():.3f} ({' '.join(f'{s:.3f}' for s in scores)})")
assert scores.mean() > 0.9, scores

model.fit(X_train, y_train)
clf = model[-1]
print(f"fitted: {clf.n_iter_} epochs, classes {clf.classes_}, training loss {clf.loss_curve_[-1]:.4f}")
test_acc = model.score(X_test, y_test)
print(f"test accuracy {test_acc:.3f}")
proba = model.predict_proba(X_test)  # (143, 2), rows summing to 1
assert proba.shape == (len(y_test), 2) and np.allclose(proba.sum(1), 1, atol=1e-5)

# The estimator saves as an mlptrain checkpoint (python -m mlptrain.predict and .evaluate read it too).
path = Path(tempfile.mkdtemp(prefix="mlptrain-example-")) / "cancer.npz"
clf.save(path)
again = MLPClassifier.load(path)
Z = model[0].transform(X_test)  # the pipeline's scaling; the checkpoint holds the network
assert np.array_equal(again.predict(Z), clf.predict(Z))
print(f"05: saved to {path} and loaded back with the same predictions")
