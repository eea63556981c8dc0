"""hydra/launcher=local's launcher (configs/hydra/launcher/local.yaml): see launcher.py. Hydra accepts
a launcher only from a `hydra_plugins` package; this directory joins the installed plugins' namespace
package when train.py's directory is on the path (it is for `python train.py`)."""
