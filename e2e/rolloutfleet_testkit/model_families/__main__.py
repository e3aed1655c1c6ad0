"""`python -m rolloutfleet_testkit.model_families [FAMILY...]`: build the family tokenizers into the cache."""

from rolloutfleet_testkit.model_families.builder import main

main()
