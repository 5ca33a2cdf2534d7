# Sourced by the sanitizer scripts: ASan/UBSan/LSan settings (any report is an error) and the
# suppressions of library-internal reports (tests/asan.supp, tests/lsan.supp).
export ASAN_OPTIONS="detect_leaks=1:abort_on_error=0:suppressions=$PWD/tests/asan.supp"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1"
export LSAN_OPTIONS="suppressions=$PWD/tests/lsan.supp:print_suppressions=0"
export OMP_WAIT_POLICY=passive
