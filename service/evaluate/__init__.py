"""`slmrank evaluate`: a candidate artifact beside a baseline on one request set, against tolerances
given before it runs (issue 29, point 2); the result recorded in the candidate (service/artifact/acceptance.py)."""
