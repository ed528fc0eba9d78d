"""Runtime hooks: module transforms applied between loading a model folder and building its stages.

One file per hook; `composer.accel.hooks` applies the enabled ones in one documented order and logs each.
"""
