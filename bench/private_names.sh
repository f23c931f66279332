#!/bin/bash
# Lines of the given files that name a private name of mxcomm.comm: a private module of it
# (imported or used), or a private attribute of a communicator class. Default: every bench script.
# Run from the repository root: bash bench/private_names.sh [FILE ...]
[ $# -gt 0 ] || set -- bench/*.py
modules=$(cd comm && ls _*.py | sed 's/\.py$//' | paste -sd'|')
grep -nE "(mxcomm\.comm import [^#]*\b($modules)\b|mxcomm\.comm\.($modules)\b|\b($modules)\.[A-Za-z]|Communicator[^,]*, \"_[a-z]|nccl_cls, \"_[a-z])" "$@"
