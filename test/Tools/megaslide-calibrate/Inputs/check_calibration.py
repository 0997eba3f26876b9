"""Checks a calibrated hardware description against the known one the
trace was made with, and megaslide-plan's prediction on it against the
trace's step (calibrate.test says the tolerances).

usage: check_calibration.py KNOWN CALIBRATED PLAN_JSON TRACE STEPS TOL FIELD...
"""
import json
import sys

known, calibrated, plan, trace = (json.load(open(p)) for p in sys.argv[1:5])
steps, tol = int(sys.argv[5]), float(sys.argv[6])
failed = False
for field in sys.argv[7:]:
    error = calibrated[field] / known[field] - 1
    print(f"{field}: known {known[field]:g}, calibrated "
          f"{calibrated[field]:g} ({100 * error:+.3f}%)")
    failed |= abs(error) > tol
spans = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
measured = (max(e["ts"] + e["dur"] for e in spans) -
            min(e["ts"] for e in spans)) * 1e-6 / steps
predicted = plan["step"]["predicted_seconds"]
error = predicted / measured - 1
print(f"step: measured {measured:.6g} s, predicted {predicted:.6g} s "
      f"({100 * error:+.3f}%)")
failed |= abs(error) > tol
print("FAIL" if failed else "OK")
