"""The methods (rtn, gptq, awq) as pure per-layer math, and the adapter the calibration loop drives; importing the
package registers every method (quantkit.algorithms.registry)."""
from quantkit.core.registry import import_all

import_all(__name__, __path__)
