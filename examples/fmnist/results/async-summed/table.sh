#!/usr/bin/env bash
# The table's runs alone (session.sh with no seeds of its first part), as they were run after it.
exec env TABLE_SEEDS="${TABLE_SEEDS:-5}" bash "$(dirname "$0")/session.sh" "$1" "$2" 0
