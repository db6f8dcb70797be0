# Store put profile (included by benchmarks/CMakeLists.txt, which globs *.cmake).
#   store_put_profile: where a put's time goes (reserve / write / publish / commit), per phase
#   p50/p99, first-touch memory against reused memory, slab path against PutStart/PutEnd.
if(TARGET mooncake_store_client AND TARGET mooncake_master)
  add_executable(store_put_profile ${CMAKE_CURRENT_LIST_DIR}/store_put_profile.cc)
  target_link_libraries(store_put_profile mooncake_store_client)
  target_compile_definitions(store_put_profile PRIVATE
                             MC_MASTER_BIN="$<TARGET_FILE:mooncake_master>")
  add_dependencies(store_put_profile mooncake_master)
  add_test(NAME store_put_profile_smoke COMMAND store_put_profile --sizes 4K --iters 200
                                                --segment 64M)
  set_tests_properties(store_put_profile_smoke PROPERTIES TIMEOUT 120 LABELS bench)
endif()
