"""The test suite; its folders mirror the kvarn_compile package."""
