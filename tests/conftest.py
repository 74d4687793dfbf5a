"""Every report.json and summary.json a test writes (in process or through a `logitdiff`
subprocess, which inherits the environment) is validated against the shipped JSON Schema
by the writer itself (logitdiff.contracts.VALIDATE_ENV); a report that breaks it fails the
test that wrote it."""

import os

from logitdiff.contracts import VALIDATE_ENV

os.environ[VALIDATE_ENV] = "1"
