// The program-less target whose build makes the precompiled Catch2 header the test programs
// reuse (tests/CMakeLists.txt, idem_test_pch).
