"""Tests of one seam each, in process: pure logic, file formats, the fake clock. No rank,
engine, trainer or mount (a few call a CLI command that only computes, such as `plan`)."""
