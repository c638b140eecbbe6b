"""The engine and everything it needs: models, proposers, verification, sampling, policy.
Never imports specdec.serving or specdec.tools."""
