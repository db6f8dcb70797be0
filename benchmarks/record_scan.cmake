# Rebuild scan cost (included by benchmarks/CMakeLists.txt, which globs *.cmake).
#   record_scan_bench: times scanRecords over a shared-memory segment full of records against
#   the walk before b785c71 (docs in the source).
if(TARGET mooncake_store_master)
  add_executable(record_scan_bench ${CMAKE_CURRENT_LIST_DIR}/record_scan_bench.cc)
  target_link_libraries(record_scan_bench mooncake_store_master)
  add_test(NAME record_scan_bench_smoke COMMAND record_scan_bench --segments 64M
                                                --objects 64K,mix --reps 1)
  set_tests_properties(record_scan_bench_smoke PROPERTIES TIMEOUT 120 LABELS bench)
endif()
