//! A segment that requires huge pages gets them when the pool has some (cargo mutants found
//! the huge-page memfd flags unchecked: every test accepted a fallback). Runs when at least
//! two 2 MiB huge pages are free; skips with one line otherwise.

use shmhca_rings::segment::{HUGE_PAGE_LEN, HugePagePool, HugePages, PageSize, Segment, Sharing};

#[test]
fn a_segment_requiring_huge_pages_is_on_hugetlbfs_when_the_pool_has_them() {
    let pool = HugePagePool::read();
    if pool.free.unwrap_or(0) < 2 || pool.size_kib != Some(2048) {
        eprintln!(
            "a_segment_requiring_huge_pages_is_on_hugetlbfs_when_the_pool_has_them: skipped: \
             fewer than 2 free 2 MiB huge pages (`echo 64 > /proc/sys/vm/nr_hugepages`)"
        );
        return;
    }
    for sharing in [Sharing::ReadWrite, Sharing::CreatorWrites] {
        let seg = match Segment::builder(0x4855, 4096)
            .huge_pages(HugePages::Require)
            .sharing(sharing)
            .populate(false)
            .create()
        {
            Ok(seg) => seg,
            // Another process may have taken the pages since the pool was read; only a
            // shortfall excuses a refusal.
            Err(e) if HugePagePool::read().free.unwrap_or(0) < 1 => {
                eprintln!("the huge pages went to another process meanwhile ({e}); skipped");
                return;
            }
            Err(e) => panic!("huge pages are free but Require failed: {e}"),
        };
        assert_eq!(seg.page_size(), PageSize::Huge2M);
        assert_eq!(seg.data_len(), HUGE_PAGE_LEN - 4096);
        let st = rustix::fs::fstat(seg.as_fd()).unwrap();
        assert_eq!(
            st.st_blksize as usize, HUGE_PAGE_LEN,
            "{sharing:?}: not on hugetlbfs"
        );
        seg.write_at(seg.data_len() - 1, &[1]).unwrap();
    }
}
