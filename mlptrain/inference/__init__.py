"""Scoring with a trained model: the Predictor and what it checks of a checkpoint and a file.

=================== ================================================================
module              what it owns
=================== ================================================================
``predictor``       :class:`Predictor` and :func:`predict` on arrays
``columns``         a file's columns matched to a model's
``consistency``     what a Predictor checks of a checkpoint at load
``outputs``         where the commands may write, outputs written as one unit
``cuda/``           inference batches as CUDA graph replays, and their kernels
=================== ================================================================
"""
